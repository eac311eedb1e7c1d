"""Splits the test files into N shards of about equal run time, for .ci/run's parallel pytest processes.

The weights are the seconds each file took in one CI-profile run on a 2-core machine (.ci/durations.txt,
refreshed by hand when it drifts: `pytest --durations=0` summed per file); a file not listed counts as the
median. Greedy, longest first, into the lightest shard. Prints one line of space-separated paths per shard.
"""
import os
import statistics
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
weights = {}
with open(os.path.join(root, ".ci", "durations.txt")) as f:
    for line in f:
        line = line.split("#")[0].split()
        if len(line) == 2:
            weights[line[0]] = float(line[1])
files = sorted(f"tests/{name}" for name in os.listdir(os.path.join(root, "tests"))
               if name.startswith("test_") and name.endswith(".py"))
default = statistics.median(weights.values()) if weights else 1.0
shards = [[0.0, []] for _ in range(n)]
for path in sorted(files, key=lambda p: -weights.get(p, default)):
    shard = min(shards, key=lambda s: s[0])
    shard[0] += weights.get(path, default)
    shard[1].append(path)
for _, paths in shards:
    print(" ".join(paths))
