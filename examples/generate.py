"""Greedy generation with a model exported by ``mula export CKPT --to hf DIR``, using transformers alone.

The export holds the training tokenizer and a ``generation_config.json`` whose EOS is the data's end-of-document
token, so ``generate`` stops where a document would end::

    python examples/generate.py out/tiny-moe-hf "def main("
    python examples/generate.py out/tiny-moe-hf "import os" --max-new-tokens 40
"""

from __future__ import annotations

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a directory written by `mula export ... --to hf`")
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    inputs = tokenizer(args.prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tokenizer.decode(output[0]))


if __name__ == "__main__":
    main()
