"""Splits the test files into N shards of about equal run time, for .ci/run's parallel pytest processes.

The weights are the seconds each file took in one CI run on a 2-core machine (.ci/durations.txt, refreshed
by hand when it drifts: each .ci/run ends with `shard.py --report` over its shards' JUnit files, which
prints the lines of that file); a file not listed counts as the median. Greedy, longest first, into the
lightest shard. Prints one line of space-separated paths per shard.
"""
import os
import statistics
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if len(sys.argv) > 1 and sys.argv[1] == "--report":
    import collections
    import xml.etree.ElementTree as ET

    seconds = collections.Counter()
    for path in sys.argv[2:]:
        for case in ET.parse(path).iter("testcase"):
            module = case.get("classname", "").split(".")
            name = "/".join(module[:2]) if module[:1] == ["tests"] else module[0]
            seconds[f"{name}.py"] += float(case.get("time", 0.0))
    for name, t in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"{name} {t:.1f}")
    sys.exit(0)
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
