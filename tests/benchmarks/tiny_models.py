"""Tiny random-weight model configurations for the CPU simulations' tests."""

from pathlib import Path
from typing import Any

import torch


def tiny_gemma3_config(sliding_window: int, positions: int = 64) -> Any:
    """Gemma 3's attention shape in miniature: head size 256 on one KV head, a sliding-window
    layer before a full-attention one."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=positions,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )


WORDS = "the a of and to in is was that it he she for on with as his her at by not be".split()


def tiny_model_dir(tmp_path: Path, with_bos: bool) -> Path:
    """A saved tiny Gemma 3 and a word-level tokenizer that puts ``<bos>`` (id 2) in front of
    every text when ``with_bos`` (as Gemma's does) and nothing otherwise (as SmolLM2's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 2)]
        )
    folder = tmp_path / ("bos" if with_bos else "no_bos")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    ).save_pretrained(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_gemma3_config(6)).save_pretrained(folder)
    return folder
