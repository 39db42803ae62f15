#!/usr/bin/env python3
"""Token shards in llm.c's format from a text file, for ds.data.shards.

    python3 examples/shards/write_shards.py input.txt OUT_DIR [--shard-tokens N] [--encoding auto|gpt2|bytes]

Each shard is a header of 256 little-endian int32 (magic 20240520, version
1, the token count, zeros) and then the tokens as uint16. The last 10% of
the tokens go to OUT_DIR/text_val_000000.bin, the rest to
OUT_DIR/text_train_000000.bin, ..., N tokens a shard (default 100M, as
llm.c's FineWeb shards).

Encodings: gpt2 is tiktoken's GPT-2 BPE with <|endoftext|> (50256) before
the text, as llm.c writes a document (vocabulary 50257); bytes is one token
per byte, 0-255 (vocabulary 256), which needs nothing installed. auto (the
default) takes gpt2 when tiktoken is installed, else bytes, and says which.
Only the standard library is used besides tiktoken.
"""
import argparse
import array
import os
import struct
import sys

MAGIC, VERSION = 20240520, 1


def encode(text, encoding):
    """The token ids of text and the vocabulary size they come from."""
    if encoding in ("auto", "gpt2"):
        try:
            import tiktoken
        except ImportError:
            if encoding == "gpt2":
                sys.exit("write_shards.py: --encoding gpt2 needs tiktoken (pip install tiktoken)")
        else:
            enc = tiktoken.get_encoding("gpt2")
            eot = enc._special_tokens["<|endoftext|>"]
            return [eot] + enc.encode_ordinary(text), "gpt2", enc.n_vocab
    return list(text.encode("utf-8")), "bytes", 256


def write_shard(path, tokens):
    header = struct.pack("<256i", MAGIC, VERSION, len(tokens), *([0] * 253))
    body = array.array("H", tokens)
    if sys.byteorder != "little":
        body.byteswap()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header)
        body.tofile(f)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("text")
    ap.add_argument("out_dir")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000)
    ap.add_argument("--encoding", choices=("auto", "gpt2", "bytes"), default="auto")
    a = ap.parse_args()
    if a.shard_tokens < 2:
        sys.exit("write_shards.py: --shard-tokens must be at least 2")
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    tokens, name, vocab = encode(text, a.encoding)
    if a.encoding == "auto" and name == "bytes":
        print("tiktoken is not installed: byte-level tokens (vocabulary 256)")
    n_val = len(tokens) // 10
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    os.makedirs(a.out_dir, exist_ok=True)
    write_shard(os.path.join(a.out_dir, "text_val_000000.bin"), val)
    k = 0
    for k, at in enumerate(range(0, len(train), a.shard_tokens)):
        write_shard(os.path.join(a.out_dir, "text_train_%06d.bin" % k), train[at:at + a.shard_tokens])
    print("%s: %d tokens (%s, vocabulary %d): %d train shards, %d val tokens in %s"
          % (a.text, len(tokens), name, vocab, k + 1, n_val, a.out_dir))
    print("train: dslua examples/shards/train.lua --data %s --vocab %d" % (a.out_dir, vocab))


if __name__ == "__main__":
    main()
