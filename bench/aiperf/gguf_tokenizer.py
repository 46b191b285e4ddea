#!/usr/bin/env python3
"""Writes a Hugging Face tokenizer directory for a GGUF model's byte-level BPE tokenizer.

    python3 gguf_tokenizer.py MODEL.gguf OUT_DIR

aiperf counts and synthesizes prompt tokens with a `transformers` tokenizer; the model ships as a
GGUF file only, and transformers' own GGUF loader needs PyTorch. This rebuilds the tokenizer from
the GGUF metadata (tokens, merges, BOS/EOS, chat template) with the `gguf`, `tokenizers` and
`transformers` packages. Only GPT-2-style BPE tokenizers (SmolLM2's) are handled.
"""

import sys

import gguf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def main():
    path, out = sys.argv[1:3]
    reader = gguf.GGUFReader(path)

    def field(name):
        return reader.fields[name].contents()

    if field("tokenizer.ggml.model") != "gpt2":
        sys.exit(f"{path}: only gpt2 (byte-level BPE) tokenizers are handled")
    tokens = field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=tokens[field("tokenizer.ggml.bos_token_id")],
        eos_token=tokens[field("tokenizer.ggml.eos_token_id")],
    )
    fast.chat_template = field("tokenizer.chat_template")
    fast.save_pretrained(out)


if __name__ == "__main__":
    main()
