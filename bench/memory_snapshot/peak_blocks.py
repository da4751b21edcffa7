"""The live allocations at the peak of a CUDA allocator snapshot (bench/memory_snapshot/sitecustomize.py): replays
the trace, finds the moment of the most allocated bytes, and groups the blocks alive then by the first stack frame
outside torch's own modules. usage: python peak_blocks.py SNAPSHOT.pickle [--top 20]"""

import argparse
import pickle
from collections import defaultdict

GIB = 1024**3
SKIP = ("torch/", "contextlib", "<frozen", "threading", "site-packages/accelerate/utils/operations")


def where(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if name.endswith(".py") and not any(s in name for s in SKIP):  # Python frames only (C++ frames come first)
            return f"{name.split('site-packages/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return "(torch internals)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    data = pickle.load(open(args.snapshot, "rb"))
    trace = data["device_traces"][0]
    peak, peak_at = 0, -1
    for replay in (False, True):  # first find the peak's event, then stop there and look at what is alive
        live, total = {}, 0
        for index, event in enumerate(trace):
            action, addr, size = event["action"], event["addr"], event["size"]
            if action == "alloc":
                live[addr] = (size, event.get("frames", []))
                total += size
                if not replay and total > peak:
                    peak, peak_at = total, index
            elif action == "free_requested" and addr in live:
                total -= live.pop(addr)[0]
            if replay and index == peak_at:
                break
    # blocks allocated before the trace began are not seen: the trace's peak is above what it started with
    groups = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        g = groups[where(frames)]
        g[0] += size
        g[1] += 1
    print(f"events {len(trace)}; peak {peak / GIB:.2f} GiB above the trace's start at event {peak_at}")
    for name, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{size / GIB:8.3f} GiB {count:6d}  {name}")


if __name__ == "__main__":
    main()
