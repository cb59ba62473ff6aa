"""A stand-in for `lm_eval --model local-completions ... --tasks gsm8k`: a tiny task of 40
questions answered through the server's completions endpoint; the stand-in scores 36/40 for the
stock arm and 35/40 for the fused one (the fused arm loses question 3 and gains none), and writes
results in lm-eval's layout, with --log_samples one samples line per question and filter."""

import argparse
import json
import urllib.request
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--model_args")
p.add_argument("--tasks")
p.add_argument("--output_path")
p.add_argument("--log_samples", action="store_true")
args, _ = p.parse_known_args()
base = dict(kv.split("=", 1) for kv in args.model_args.split(","))["base_url"].rsplit("/v1/", 1)[0]
urllib.request.urlopen(urllib.request.Request(f"{base}/v1/completions", data=b"{}", method="POST")).read()
switch = json.loads(urllib.request.urlopen(f"{base}/standin/arm").read())["switch"]
correct = 36 if switch in ("stock", "0", "") else 35
out = Path(args.output_path, "model")
out.mkdir(parents=True, exist_ok=True)
(out / "results_2026-11-29.json").write_text(json.dumps({
    "results": {args.tasks: {"exact_match,strict-match": correct / 40, "exact_match,flexible-extract": correct / 40}},
    "n-samples": {args.tasks: {"original": 40, "effective": 40}},
}))
if args.log_samples:
    right = set(range(36)) if correct == 36 else set(range(36)) - {3}
    rows = [{"doc_id": q, "filter": f, "metrics": ["exact_match"], "exact_match": float(q in right)}
            for q in range(40) for f in ("strict-match", "flexible-extract")]
    (out / f"samples_{args.tasks}_2026-11-29.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
