"""A stand-in for `lm_eval --model local-completions ... --tasks gsm8k`: a tiny task of 40
questions answered through the server's completions endpoint; the stand-in scores 36/40 for the
stock arm and 35/40 for the fused one, and writes results in lm-eval's layout."""

import argparse
import json
import urllib.request
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--model_args")
p.add_argument("--tasks")
p.add_argument("--output_path")
args, _ = p.parse_known_args()
base = dict(kv.split("=", 1) for kv in args.model_args.split(","))["base_url"].rsplit("/v1/", 1)[0]
urllib.request.urlopen(urllib.request.Request(f"{base}/v1/completions", data=b"{}", method="POST")).read()
switch = json.loads(urllib.request.urlopen(f"{base}/standin/arm").read())["switch"]
correct = 36 if switch == "stock" else 35
out = Path(args.output_path, "model")
out.mkdir(parents=True, exist_ok=True)
(out / "results_2026-11-29.json").write_text(json.dumps({
    "results": {args.tasks: {"exact_match,strict-match": correct / 40, "exact_match,flexible-extract": correct / 40}},
    "n-samples": {args.tasks: {"original": 40, "effective": 40}},
}))
