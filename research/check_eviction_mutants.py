"""Mutation check of the eviction policies' tests (issue 39): delete or change one term of a policy in
runtime/cache/eviction.py or next_use.py at a time, run the policies' fast tests (tests/test_eviction_terms.py,
tests/test_cache.py, the known-answer tests of tests/test_next_use.py), restore the file. Every mutation must be
KILLED (some test fails). Run from the repository root; never leaves a file changed.

    python research/check_eviction_mutants.py          # all
    python research/check_eviction_mutants.py 4 5      # by index
"""

import subprocess
import sys

P = "fate_edge/runtime/cache/eviction.py"
NU = "fate_edge/runtime/cache/next_use.py"
# (what it is, text in eviction.py, what replaces it); a fourth item names another file
M = [
    (
        "LCU: drop high-precision count",
        "cost = self.high.get(key, 0) + self.ratio * self.low.get(key, 0)",
        "cost = self.ratio * self.low.get(key, 0)",
    ),
    (
        "LCU: drop low-precision count",
        "cost = self.high.get(key, 0) + self.ratio * self.low.get(key, 0)",
        "cost = self.high.get(key, 0)",
    ),
    (
        "LCU: low uses weighed as high (ratio 1)",
        "cost = self.high.get(key, 0) + self.ratio * self.low.get(key, 0)",
        "cost = self.high.get(key, 0) + self.low.get(key, 0)",
    ),
    ("LCU: drop normalisation by forward passes", "p = cost / max(1, self.t + 1)", "p = cost"),
    ("LCU: drop +1/D distance term", "            p += 1.0 / distance\n", "            pass\n"),
    (
        "LCU: distance measured backwards",
        "distance = (key[0] - self.layer_now + self.num_layers)",
        "distance = (self.layer_now - key[0] + self.num_layers)",
    ),
    ("LCU: bonus for every expert, not only previous pass", "if key in self.used_prev:", "if True:"),
    (
        "LCU: no reset per sequence",
        "    def new_sequence(self) -> None:\n        self.high:",
        "    def new_sequence(self) -> None:\n        if hasattr(self, 'high'):\n            return\n"
        "        self.high:",
    ),
    (
        "ARC: drop B1 ghost adaptation (p += ...)",
        "self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))",
        "pass",
    ),
    (
        "ARC: drop B2 ghost adaptation (p -= ...)",
        "self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))",
        "pass",
    ),
    ("ARC: B1 step always 1", "self.p + max(1.0, len(self.b2) / max(1, len(self.b1)))", "self.p + 1.0"),
    ("ARC: B2 step always 1", "self.p - max(1.0, len(self.b1) / max(1, len(self.b2)))", "self.p - 1.0"),
    (
        "ARC: victim ignores p (T1 first always)",
        "prefer_t1 = t1 and (len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) == int(self.p)))",
        "prefer_t1 = bool(t1)",
    ),
    ("ARC: ghosts not trimmed", "        while len(self.b1) > self.c:\n            self.b1.popitem(last=False)\n", ""),
    (
        "ARC: evicted keys not remembered in B1",
        "            del self.t1[key]\n            self.b1[key] = None",
        "            del self.t1[key]",
    ),
    (
        "ARC: victim drops the B2-incoming rule",
        "prefer_t1 = t1 and (len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) == int(self.p)))",
        "prefer_t1 = t1 and len(self.t1) > self.p",
    ),
    (
        "ARC: B1 ghost hit joins T1 not T2",
        "            del self.b1[key]\n            self.t2[key] = None",
        "            del self.b1[key]\n            self.t1[key] = None",
    ),
    (
        "popularity: no decay",
        "return self.score.get(key, 0.0) * self.decay ** (self.clock - self.stamp.get(key, self.clock))",
        "return self.score.get(key, 0.0)",
    ),
    (
        "LFU: drop recency tie-break",
        "key=lambda k: (self.count.get(k, 0), self.lru.last.get(k, -1), k)",
        "key=lambda k: (self.count.get(k, 0), k)",
    ),
]
M += [
    (name, a, b, NU)
    for name, a, b in [
        (
            "next-use: no per-token decay of use counts",
            "return self.count.get(key, 0.0) * self.cfg.decay ** (self.t - self.stamp.get(key, self.t))",
            "return self.count.get(key, 0.0)",
        ),
        (
            "next-use: calibration share ignored (uniform prior)",
            "        if key in self.seed:\n            return self.seed[key]\n",
            "",
        ),
        (
            "next-use: no prior at all in p_token",
            "return min(1.0, (self._decayed(key) + w * prior) / (tokens + w)) + 1e-3",
            "return min(1.0, self._decayed(key) / tokens) + 1e-3",
        ),
        (
            "next-use: transitions ignored (p_next = p_token)",
            "        if not src:\n            return min(1.0, p)",
            "        if True:\n            return min(1.0, p)",
        ),
        (
            "next-use: layer distance dropped",
            "return d + (1.0 - self.p_next(key)) * n / self.p_token(key)",
            "return (1.0 - self.p_next(key)) * n / self.p_token(key)",
        ),
        (
            "next-use: later-token term dropped",
            "return d + (1.0 - self.p_next(key)) * n / self.p_token(key)",
            "return d + (1.0 - self.p_next(key)) * n",
        ),
        (
            "next-use: no bypass",
            "if not self.cfg.bypass or self.bypassed_in == self.call",
            "if True or self.bypassed_in == self.call",
        ),
        (
            "next-use: bypass not limited to one per call",
            "if not self.cfg.bypass or self.bypassed_in == self.call",
            "if not self.cfg.bypass",
        ),
        (
            "next-use: no reset per sequence",
            "    def new_sequence(self) -> None:\n        self.t = 0",
            '    def new_sequence(self) -> None:\n        if hasattr(self, "count"):\n            return\n'
            "        self.t = 0",
        ),
    ]
]
only = sys.argv[1:] or None
tests = [
    "tests/test_eviction_terms.py",
    "tests/test_cache.py",
    "tests/test_next_use.py",
    "-k",
    "not engine and not simulator and not device_preset",
]
originals = {f: open(f).read() for f in (P, NU)}
try:
    for i, (name, a, b, *where) in enumerate(M):
        if only and str(i) not in only:
            continue
        path = where[0] if where else P
        assert originals[path].count(a) == 1, name
        open(path, "w").write(originals[path].replace(a, b))
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], capture_output=True, text=True
        )
        open(path, "w").write(originals[path])
        failed = [line.split("::")[1].split(" ")[0] for line in r.stdout.splitlines() if line.startswith("FAILED")]
        print(f"{i:2d} {'KILLED' if r.returncode else 'SURVIVED'}  {name}  {failed}", flush=True)
finally:
    for path, text in originals.items():
        open(path, "w").write(text)
