"""A stand-in for `vllm bench serve`: asks the server which arm it is and writes a result JSON with
the keys vllm bench writes; the off and stock arms are slower (TPOT 20 ms against 19 ms), with a
little seeded noise per call."""

import argparse
import json
import random
import urllib.request
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--base-url")
p.add_argument("--max-concurrency", type=int)
p.add_argument("--result-dir")
p.add_argument("--result-filename")
args, _ = p.parse_known_args()
switch = json.loads(urllib.request.urlopen(f"{args.base_url}/standin/arm").read())["switch"]
noise = random.Random(f"{args.result_dir}{args.max_concurrency}").uniform(-0.05, 0.05)
tpot = (20.0 if switch in ("stock", "0", "") else 19.0) + noise  # only the overlay on is faster
result = {"median_ttft_ms": 100.0 + noise, "p99_ttft_ms": 120.0 + noise, "median_tpot_ms": tpot,
          "p99_tpot_ms": tpot * 1.2, "median_itl_ms": tpot, "p99_itl_ms": tpot * 1.3,
          "median_e2el_ms": 100 + 8192 * tpot, "p99_e2el_ms": 120 + 8192 * tpot,
          "output_throughput": args.max_concurrency * 1000.0 / tpot}
Path(args.result_dir, args.result_filename).write_text(json.dumps(result))
