"""A loopback stand-in for `vllm serve MODEL --port P ...`: it leaves overlay evidence exactly as a
vLLM process with the overlay would (the real Evidence and marker code, from K3_AMD_OVERLAY), and
answers /health, /v1/completions, /v1/chat/completions and /standin/arm until stopped.
STANDIN_LIE=stock makes it record stock whatever the switch says (an arm mix-up to be caught);
STANDIN_SERVED_NAME answers 404 to a completion for any other model name, as vLLM does.
STANDIN_KERNEL_FAILS=1 makes every fused kernel fail when the bench (or lm-eval) first asks
/standin/arm: the overlay's own refusal (kernel_failures.refuse) marks each fusion refused and the
process runs stock from then on, as a server whose kernel fails mid-run does. Otherwise each ask of
/standin/arm serves one batch through each fusion's fused path, as the measurement's batches do,
unless STANDIN_GATED=1: a self-measurement sends every batch the measurement makes to stock."""

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from k3_amd_overlay import kernel_failures
from k3_amd_overlay.evidence import Evidence
from k3_amd_overlay.fusions.states import FusionState, LayerDecision
from k3_amd_overlay.settings import Mode, load_settings

port = int(sys.argv[sys.argv.index("--port") + 1])
env = dict(os.environ)
if env.get("STANDIN_LIE"):
    env["K3_AMD_OVERLAY"] = env["STANDIN_LIE"]
settings = load_settings(env)
evidence = Evidence(settings) if settings.enabled else None  # off: the plugin installs nothing


def execute_model(hook):  # named as vLLM's worker names the step serving a batch: the stand-in's batch is served
    hook(1)


for fusion in settings.fusions if evidence else ():
    if settings.mode is Mode.AUTO:
        evidence.note_layer(fusion, LayerDecision(FusionState.APPLIED, "standin", "stand-in"))
        execute_model(evidence.effective_hook(fusion, "model.layers.3.self_attn.attn"))
    else:
        evidence.note_layer(fusion, LayerDecision(FusionState.FORCED_STOCK, None, "stock mode"))
if evidence:
    evidence.publish()
else:  # as the plugin does with the overlay off: one off record, nothing patched
    from k3_amd_overlay import off_record

    off_record.leave(settings)


def kernels_fail() -> None:
    """Every requested fusion's kernel fails now: refused for the rest of this process."""
    for fusion in settings.fusions if evidence else ():
        failure = kernel_failures.KernelFailed(fusion, RuntimeError("stand-in: the kernel failed to launch"))
        kernel_failures.refuse(failure, lambda name, why: evidence.set_fusion(name, FusionState.REFUSED, why))


class Handler(BaseHTTPRequestHandler):
    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._reply({})
        elif self.path == "/standin/arm":
            if os.environ.get("STANDIN_KERNEL_FAILS"):
                kernels_fail()
            elif evidence and settings.mode is Mode.AUTO and not os.environ.get("STANDIN_GATED"):
                for fusion in settings.fusions:
                    execute_model(evidence.effective_hook(fusion, "model.layers.3.self_attn.attn"))
            self._reply({"switch": os.environ.get("K3_AMD_OVERLAY", "")})
        else:
            self.send_error(404)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        served = os.environ.get("STANDIN_SERVED_NAME")
        if served and body and json.loads(body).get("model") != served:  # as vLLM answers a model it does not serve
            self.send_error(404, f"The model does not exist; this server serves {served}")
            return
        self._reply({"choices": [{"text": " Paris"}]})

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
signal.signal(signal.SIGINT, lambda *a: os._exit(0))  # as vLLM does on Ctrl-C: stop now
server.serve_forever()
