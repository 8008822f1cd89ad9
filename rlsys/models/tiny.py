"""The embedded default model: a character-level tokenizer and a tiny Qwen2/Llama model, built offline.

Nothing is downloaded: the vocabulary is the 256 bytes plus pad, eos and unk, so the synthetic tasks (and any
ASCII text) tokenize one character per token, and the weights come from a seeded init.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

from rlsys.config import ModelConfig

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"

ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (so per ASCII character): a byte-level BPE with no merges.

    This is the shape transformers' Qwen2 tokenizer rebuilds itself into when AutoTokenizer loads a
    qwen2 model dir, so the saved tokenizer.json and the class AutoTokenizer picks agree exactly.
    Special tokens come first: pad=0, eos=1, unk=2 (never produced: every byte is in the vocabulary,
    but naming it stops the Qwen2 class from adding a default unk beyond the embedding table).
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *alphabet])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="right", model_max_length=100_000)


def build_tiny_model(cfg: ModelConfig, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a standard HF directory (config, safetensors weights, tokenizer) for `cfg`, seeded."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    config_cls, model_cls = ARCHS[cfg.arch]
    config = config_cls(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=None)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
