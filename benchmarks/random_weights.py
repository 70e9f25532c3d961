"""Write a model folder with random weights from another folder's config and tokenizer.

    python benchmarks/random_weights.py SOURCE_FOLDER TARGET_FOLDER [--device cuda]

For speed measurements where the real weights cannot travel (the GPU test machine takes at most
64 MiB per run): throughput does not depend on the weight values. SOURCE needs config.json and
the tokenizer files, not the weights.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--device", default="cpu", help="where to initialise (cuda is much faster for big models)")
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.source)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.target)
    AutoTokenizer.from_pretrained(args.source).save_pretrained(args.target)
    print(f"wrote {args.target}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M random parameters")


if __name__ == "__main__":
    main()
