"""Values from files and flags are data, never code: the one place that writes them as YAML scalars, shell words
and one-line comments, and checks the values that cannot be quoted where they land (host names, run names)."""

from __future__ import annotations

import ipaddress
import re
import shlex
import unicodedata

import yaml

from . import UserError

# characters that end a comment line or that a terminal or editor interprets: control characters, surrogates
# (the bytes of a non-UTF-8 argument), YAML 1.1's extra line breaks (NEL, U+2028, U+2029) and bidi overrides
_UNSAFE_CATEGORIES = {"Cc", "Cs", "Zl", "Zp"}
_BIDI_CONTROLS = set("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _unsafe(char: str) -> bool:
    return unicodedata.category(char) in _UNSAFE_CATEGORIES or char in _BIDI_CONTROLS


def comment_text(value, keep: str = "") -> str:
    """Any value as text that stays on one comment line: unsafe characters written as Python escapes (\\n, \\x1b).
    keep: characters left as they are (a message for a terminal keeps its line breaks)."""
    text = str(value)
    if not any(_unsafe(c) and c not in keep for c in text):
        return text
    return "".join(c.encode("unicode_escape").decode("ascii") if _unsafe(c) and c not in keep else c for c in text)


def has_surrogates(text: str) -> bool:
    """Python's stand-ins for bytes that are not UTF-8 (command-line arguments, file names)."""
    return any("\ud800" <= c <= "\udfff" for c in text)


# a string PyYAML and LLaMA-Factory's loader read back as itself when written without quotes
_PLAIN_YAML = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_./+-]*")


def yaml_scalar(value) -> str:
    """A value as one YAML scalar on one line: true/false, 3.0e-6, null, a flow collection, or a string that reads
    back exactly (double-quoted with escapes when it holds anything YAML or a comment could interpret)."""
    from .recipe.read import LlamaFactoryLoader  # the loader LLaMA-Factory reads with (floats like 3e-6)

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return yaml_float(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):  # a flow collection, also as a `key=value` override
        return "{" + ", ".join(f"{yaml_scalar(k)}: {yaml_scalar(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
    text = str(value)
    if _PLAIN_YAML.fullmatch(text) and yaml.load(text, Loader=LlamaFactoryLoader) == text:
        return text
    return yaml.safe_dump(text, default_style='"', width=float("inf"), allow_unicode=True).strip()


def yaml_float(value) -> str:
    """Floats as LLaMA-Factory's YAML loaders read them: 3.0e-6, 2.0 (a bare 3e-6 is a string to PyYAML)."""
    value = float(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
        mantissa, exponent = f"{value:e}".split("e")
        mantissa = mantissa.rstrip("0")
        mantissa = mantissa + "0" if mantissa.endswith(".") else mantissa
        exponent = int(exponent)
        return f"{mantissa}e{exponent:+d}" if exponent > 0 else f"{mantissa}e{exponent}"
    return repr(value)


_ANSI_C_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def shell_word(value) -> str:
    """A value as one bash word that expands to exactly that value: single quotes, or $'...' escapes where the
    value holds control characters or bytes that are not UTF-8 (which single quotes would keep raw)."""
    text = str(value)
    if "\0" in text:
        raise UserError(f"'{comment_text(text)}': a NUL character cannot be written into a shell script")
    if not any(_unsafe(c) for c in text):
        return shlex.quote(text)
    parts = []
    for char in text:
        if char in _ANSI_C_ESCAPES:
            parts.append(_ANSI_C_ESCAPES[char])
        elif has_surrogates(char):  # the original byte
            parts.append(f"\\x{ord(char) - 0xDC00:02x}")
        elif _unsafe(char):
            parts.append("".join(f"\\x{b:02x}" for b in char.encode("utf-8")))
        else:
            parts.append(char)
    return "$'" + "".join(parts) + "'"


def shell_export(name: str, value: str, keep_existing: bool = False) -> str:
    """`export NAME=value` for a bash script; keep_existing: a value already in the environment wins."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise UserError(f"'{comment_text(name)}' is not an environment variable name")
    word = shell_word(value)
    return f"export {name}=${{{name}:-{word}}}" if keep_existing else f"export {name}={word}"


_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?")


def host_problem(value) -> str | None:
    """Why value is not a host name, an IPv4 or an IPv6 address (None when it is one)."""
    text = str(value)
    if _HOST_NAME.fullmatch(text):
        return None
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        return (
            f"'{comment_text(text)[:80]}' is not a host name or IP address (letters, digits, '.', '-', '_'; "
            "an IPv6 address with ':')"
        )


def port_problem(value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        return f"'{comment_text(value)[:80]}' is not a port number (1-65535)"
    return None


def run_name_problem(name: str) -> str | None:
    """Why name cannot name a run folder under runs/ (None when it can)."""
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return f"'{comment_text(name)}' is not a folder name (no '/', not '.' or '..')"
    if any(_unsafe(c) for c in name) or len(name) > 200:
        return f"'{comment_text(name)[:80]}': a run name is one line of printable text, at most 200 characters"
    return None


def key_problem(key: str) -> str | None:
    """Why key cannot be a LLaMA-Factory argument name (None when it can)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return None
    return f"'{comment_text(key)[:80]}' is not an argument name (letters, digits and '_')"
