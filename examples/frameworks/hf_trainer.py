"""The HF Trainer on pycoll: make the group first, then ``TrainingArguments``/``Trainer``.

    torchrun --nproc-per-node 2 examples/frameworks/hf_trainer.py pycoll out.json   # or gloo

The Trainer makes its group through Accelerate, which refuses any CPU backend but gloo and
mpi: ``TrainingArguments(ddp_backend="pycoll")`` raises "Your assigned backend pycoll is not
available, please use gloo" (and the command line's ``--ddp_backend`` lists its choices).
With the group made first (``dist.init_process_group("pycoll")``, ``ddp_backend`` left
unset) it trains on pycoll. A one-layer GPT-2 built from a config, generated tokens: no
download. (``by-name`` shows the refusal.)
"""

import json
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def main(mode: str, out: str) -> None:
    common = dict(output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=4, max_steps=6,
                  learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no", seed=0,
                  dataloader_num_workers=0, disable_tqdm=True)
    if mode == "by-name":
        try:
            TrainingArguments(ddp_backend="pycoll", **common).device
            print("RESULT no error")
        except ValueError as exc:
            print(f"RESULT {exc}")
        return
    if mode == "pycoll":
        dist.init_process_group("pycoll")          # the recipe: the group first
    args = TrainingArguments(ddp_backend="gloo" if mode == "gloo" else None, **common)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (48, 16), generator=g)]
    Trainer(model=model, args=args, train_dataset=data).train()
    if args.process_index == 0:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        with open(out, "w") as f:
            json.dump({"backend": dist.get_backend(), "weights": weights.tolist()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
