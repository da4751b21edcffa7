"""The environment variables through which lfa's supervisor (and launch.sh) talk to its plugin inside LLaMA-Factory's
processes: one name each, imported by both sides. boot/sitecustomize.py, which runs before any import, spells
LFA_REQUIRE_PLUGIN itself."""

import os

# set by launch_env for the plan (launch.sh and lfa train)
DROP_PADDING_MASK = "LFA_DROP_PADDING_MASK"  # "1": right-padded batches train without a padding mask
PADDING_FREE = "LFA_PADDING_FREE"  # "1": each micro-batch's rows flattened, attention kept per row
SORTED_STEPS = "LFA_SORTED_STEPS"  # "1": micro-batches sorted by length inside each optimizer step
TOKEN_BUDGET = "LFA_TOKEN_BUDGET"  # N: each optimizer step's rows cut into micro-batches of at most N tokens
CHECKPOINT_LAYERS = "LFA_CHECKPOINT_LAYERS"  # k: only the first k decoder layers recompute their forward
MASTER_WEIGHTS = "LFA_MASTER_WEIGHTS"  # "1": 16-bit weights in the model, fp32 masters in the optimizer
# "0": master weights' linear layers leave their weight gradients to the hook's add (before session 40), to compare
FUSED_WEIGHT_GRADIENTS = "LFA_FUSED_WGRAD"
GC_FREEZE = "LFA_GC_FREEZE"  # "1": objects alive when training starts are left out of garbage collections
# set by lfa train per attempt
EVENTS_FILE = "LFA_EVENTS_FILE"  # where the plugin appends its JSON events
SUPERVISOR_PID = "LFA_SUPERVISOR_PID"  # the trainer saves and stops when this process is gone
ATTEMPT = "LFA_ATTEMPT"  # the attempt number stamped on every event
CHAT_TEMPLATE_DIRS = "LFA_CHAT_TEMPLATE_DIRS"  # extra folders of chat templates to register
REQUIRE_PLUGIN = "LFA_REQUIRE_PLUGIN"  # fail loudly when the plugin cannot load
COMM_PROFILE_STEPS = "LFA_COMM_PROFILE_STEPS"  # "3-4" (default), "off": the communication profiler's window
KERNEL_PROFILE = "LFA_KERNEL_PROFILE"  # "1": profile that window on one process too, GPU time by kernel kind
FUSED_GATE_UP = "LFA_FUSED_GATE_UP"  # "0": liger's Phi-3 MLP as liger runs it (chunk copies), for comparison
LOSS_CHUNK_ROWS = "LFA_LOSS_CHUNK_ROWS"  # N: liger's fused loss in chunks of at least N rows (unset 2048, "0" liger's)
# "1" (inductor) or a dynamo backend's name: torch.compile each decoder layer, liger keeping only its fused loss (a
# bench experiment, issue 33: never planned, not priced)
COMPILE_LAYERS = "LFA_COMPILE_LAYERS"
ATTENTION_ROW_VIEW = "LFA_ATTENTION_ROW_VIEW"  # "0": varlen attention indexes its row (before session 30), to compare
PADDED_WIDTH_ALIGNED = "LFA_PADDED_WIDTH_ALIGNED"  # "0": padded micro-batches as wide as their longest row, to compare
# tests and benchmarks: faults a CPU cannot have, emulated cards and models
EMULATE_VRAM_GIB = "LFA_EMULATE_VRAM_GIB"  # cap the CUDA caching allocator (real CUDA OOMs on a bigger card)
EMULATE_MODEL = "LFA_EMULATE_MODEL"  # plan OOM recovery for this model's shape instead of the trained one
INJECT_OOM_ABOVE_MBS = "LFA_INJECT_OOM_ABOVE_MBS"
INJECT_OOM_MESSAGE = "LFA_INJECT_OOM_MESSAGE"
INJECT_NAN_AT_STEP = "LFA_INJECT_NAN_AT_STEP"
STEP_DELAY_S = "LFA_STEP_DELAY_S"
INJECT_PEAK_GIB = "LFA_INJECT_PEAK_GIB"  # report this GPU peak (GiB) where there is no GPU
BENCH_SKIP_FINAL_SAVE = "LFA_BENCH_SKIP_FINAL_SAVE"


def env_count(name: str) -> int:
    """A count the supervisor sets in the environment (a token budget, a number of layers); 0 where it is unset or
    is not a whole number (a hand-set value must not stop training inside LLaMA-Factory)."""
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else 0
