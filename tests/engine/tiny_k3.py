"""A tiny Kimi-K3 checkpoint written at test time: K3's real MLA dimensions (from the package's one
home for them), few heads, 2 MLA layers, dense MLP, a small vision tower that is never fed, and a
byte-level BPE tokenizer trained offline with the `tokenizers` library. No weights are written:
the engine tests load with ``--load-format dummy`` and the test kit sets deterministic fan-in
scaled weights after loading (K3ENGINE_WEIGHTS=fanin)."""

from __future__ import annotations

import json
from pathlib import Path

from k3_amd_overlay import k3

NUM_HEADS = 4  # kv_lora_rank * heads = 2048: vLLM 0.32's own fused-decode threshold, exactly
HIDDEN = 256
LAYERS = 2
MAX_MODEL_LEN = 512

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May? Answer: 72",
    "Kimi reads long documents and answers questions about them.",
    "One plus one is two. Two plus two is four. Three times three is nine.",
    "The cache holds keys and values; the query attends to every cached token.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 #### The answer is",
]
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|media_pad|>"]


def _train_tokenizer(target: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "model_max_length": MAX_MODEL_LEN, "clean_up_tokenization_spaces": False,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
    }))
    (target / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}))
    return tokenizer.get_vocab_size()


def write_checkpoint(target: Path, architecture: str = "KimiK3ForConditionalGeneration") -> Path:
    """Write the checkpoint's files into ``target`` (created) and return it: Kimi-K3 by default, or
    ``KimiLinearForCausalLM`` (Kimi-Linear: the same ``amd/linear.py`` MLA layers, no vision)."""
    target.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(target)
    ids = {name: i for i, name in enumerate(SPECIALS)}
    text_config = {
        "model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS, "hidden_act": "silu", "rms_norm_eps": k3.RMS_NORM_EPS,
        "q_lora_rank": k3.Q_LORA_RANK, "kv_lora_rank": k3.KV_LORA_RANK,
        "qk_nope_head_dim": k3.QK_NOPE_HEAD_DIM, "qk_rope_head_dim": k3.QK_ROPE_HEAD_DIM,
        "v_head_dim": k3.V_HEAD_DIM, "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": None, "num_experts": None, "num_nextn_predict_layers": 0,
        "max_position_embeddings": MAX_MODEL_LEN, "tie_word_embeddings": False,
        "bos_token_id": ids["<|bos|>"], "eos_token_id": ids["<|eos|>"], "pad_token_id": ids["<|pad|>"],
        "torch_dtype": "bfloat16",
    }
    vision_config = {
        "model_type": "kimi_k3_vision", "patch_size": 14, "vt_num_attention_heads": 2,
        "vt_num_hidden_layers": 1, "vt_hidden_size": 64, "vt_intermediate_size": 128,
        "init_pos_emb_height": 8, "init_pos_emb_width": 8, "qkv_hidden_size": 64,
        "text_hidden_size": HIDDEN,
    }
    config = {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text_config, "vision_config": vision_config,
        "layer_types": ["full_attention"] * LAYERS,
        "media_placeholder_token_id": ids["<|media_pad|>"], "pad_token_id": ids["<|pad|>"],
        "bos_token_id": ids["<|bos|>"], "eos_token_id": ids["<|eos|>"],
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }
    if architecture == "KimiLinearForCausalLM":
        config = {**text_config, "architectures": [architecture], "layer_types": ["full_attention"] * LAYERS}
    (target / "config.json").write_text(json.dumps(config, indent=1))
    (target / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|bos|>"], "eos_token_id": ids["<|eos|>"]}))
    (target / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "KimiK25FusedVisionProcessor",
        "media_proc_cfg": {
            "patch_size": 14, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4,
            "in_patch_limit": 16, "in_patch_limit_video": 16, "patch_limit_on_one_side": 8,
            "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        },
    }))
    return target


if __name__ == "__main__":
    import sys

    print(write_checkpoint(Path(sys.argv[1])))
