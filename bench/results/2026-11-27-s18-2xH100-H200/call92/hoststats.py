"""Self / inclusive host time per Python function from a torch.profiler chrome trace
(with_stack=True): self = duration minus the nested python_function and cpu_op events.
Usage: hoststats.py TRACE.json [N]"""
import collections
import gzip
import json
import sys

opener = gzip.open if sys.argv[1].endswith(".gz") else open
trace = json.load(opener(sys.argv[1], "rt"))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
events = [
    e for e in trace["traceEvents"]
    if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op")
]
by_thread = collections.defaultdict(list)
for e in events:
    by_thread[e["tid"]].append(e)
self_t = collections.Counter()
incl = collections.Counter()
count = collections.Counter()
for tid, evs in by_thread.items():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []  # [event, child_time]
    def close_until(ts):
        while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= ts:
            ev, child = stack.pop()
            key = ("py " if ev["cat"] == "python_function" else "op ") + ev["name"]
            self_t[key] += ev["dur"] - child
            if stack:
                stack[-1][1] += ev["dur"]
    for e in evs:
        close_until(e["ts"])
        key = ("py " if e["cat"] == "python_function" else "op ") + e["name"]
        names_open = {("py " if s[0]["cat"] == "python_function" else "op ") + s[0]["name"] for s in stack}
        if key not in names_open:
            incl[key] += e["dur"]
        count[key] += 1
        stack.append([e, 0.0])
    close_until(float("inf"))
print(f"{'self ms':>9} {'incl ms':>9} {'calls':>7}  name")
for key, v in self_t.most_common(top):
    print(f"{v/1e3:9.2f} {incl[key]/1e3:9.2f} {count[key]:7d}  {key[:130]}")
