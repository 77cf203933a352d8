"""The training loop: AdamW on the LoRA parameters, schedules, accumulation, checkpoints, resume.

Determinism: the data order of epoch ``e`` is a permutation seeded by ``seed + e``; a checkpoint
stores the LoRA tensors (fp32), the optimizer and scheduler states, every RNG state and the
position in the data (micro-batches consumed), so a resumed run computes the same steps as an
uninterrupted one.  The loss of a step is the token-mean cross-entropy over all response tokens
of its ``gradient_accumulation_steps`` micro-batches (each micro-batch's gradient is weighted by
its share of those tokens).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .adapter import ADAPTER_CONFIG, save_adapter
from .templates import IGNORE_INDEX

STATE_FILE = "trainer_state.pt"
LOG_FILE = "trainer_log.jsonl"
PLOT_FILE = "training_loss.png"
#: keys whose change makes a checkpoint describe another run
RESUME_KEYS = ("seed", "per_device_train_batch_size", "gradient_accumulation_steps", "dataset", "cutoff_len",
               "template", "lora_rank", "lora_target", "max_steps", "num_train_epochs", "learning_rate",
               "lr_scheduler_type")


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def target_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """Right-padded batch (pad positions: attention 0, label -100)."""
    n = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(y)] = torch.tensor(y)
        mask[i, :len(x)] = 1
    return Batch(ids, mask, labels)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the labelled positions (fp32)."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, v), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class SavedActivations:
    """Bytes autograd keeps between a forward and its backward: every tensor the ops save (the CPU
    experts' Function and gradient checkpointing's kept layer inputs included), counted once per
    storage through torch's saved-tensor hooks, the model's parameters left out."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += st.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class Trainer:
    def __init__(self, cfg, tm, rows: list[tuple[list[int], list[int]]], log=print):
        self.cfg = cfg
        self.tm = tm
        self.rows = rows
        self.log = log
        self.out = cfg.resolve("output_dir")
        self.pad_id = tm.tokenizer.pad_token_id
        B = cfg.per_device_train_batch_size
        self.micro_per_epoch = math.ceil(len(rows) / B)
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / cfg.gradient_accumulation_steps)
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else \
            max(1, math.ceil(cfg.num_train_epochs * self.steps_per_epoch))
        self.params = [p for _, p in tm.trainable()]
        self.device_types = sorted({p.device.type for p in tm.model.parameters()} | {"cpu"})
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        from transformers import get_scheduler

        warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * self.total_steps)
        self.scheduler = get_scheduler(cfg.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup,
                                       num_training_steps=self.total_steps)
        self.step = 0
        self.micro = 0  # micro-batches consumed
        self.losses: list[float] = []
        self.records: list[dict] = []
        self._orders: dict[int, list[int]] = {}
        #: saved-activation bytes of the run's first micro-batch (measured once, then logged)
        self.saved_activation_bytes: int | None = None

    # -- data position ---------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.cfg.seed + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=g).tolist()}
        return self._orders[epoch]

    def micro_batch(self, m: int) -> Batch:
        epoch, i = divmod(m, self.micro_per_epoch)
        B = self.cfg.per_device_train_batch_size
        idx = self._order(epoch)[i * B:(i + 1) * B]
        return collate([self.rows[j] for j in idx], self.pad_id)

    # -- one optimizer step ----------------------------------------------------------
    def train_step(self) -> tuple[float, int]:
        """(loss, tokens) of one optimizer step."""
        ga = self.cfg.gradient_accumulation_steps
        batches = [self.micro_batch(m) for m in range(self.micro, self.micro + ga)]
        n_target = sum(b.target_tokens for b in batches)
        model = self.tm.model
        total = 0.0
        for b in batches:
            if b.target_tokens == 0:
                continue
            with contextlib.ExitStack() as stack:
                saved = None
                if self.saved_activation_bytes is None:
                    saved = stack.enter_context(SavedActivations(model.parameters()))
                for kind in self.device_types:  # bf16 autocast wherever modules run
                    stack.enter_context(torch.autocast(kind, dtype=torch.bfloat16, enabled=self.cfg.bf16))
                logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits
                loss_sum = token_loss_sum(logits, b.labels.to(logits.device))
            if saved is not None:
                self.saved_activation_bytes = saved.bytes
                self.log(f"saved activations of one micro-batch ({b.tokens} tokens): {saved.bytes / 2**20:.3g} MiB "
                         f"(gradient checkpointing {'on' if self.cfg.checkpointing else 'off'})")
            (loss_sum / n_target).backward()
            total += float(loss_sum.detach())
        if self.cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.micro += ga
        self.step += 1
        return total / max(1, n_target), sum(b.tokens for b in batches)

    # -- the run -----------------------------------------------------------------------
    def run(self) -> list[float]:
        from tqdm import tqdm

        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        log_path = self.out / LOG_FILE
        log_path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        bar = tqdm(total=self.total_steps, initial=self.step, desc="training", unit="step", dynamic_ncols=True)
        window_loss, window_tokens, window_t = [], 0, time.perf_counter()
        tok_s = 0.0
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            loss, tokens = self.train_step()
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                bar.close()
                raise ConfigError(f"learning_rate: the loss became {loss} at step {self.step}; lower it")
            self.losses.append(loss)
            window_loss.append(loss)
            window_tokens += tokens
            tok_s = tokens / dt if dt > 0 else 0.0
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:.0f}")
            bar.update(1)
            if self.step % cfg.logging_steps == 0 or self.step == self.total_steps:
                now = time.perf_counter()
                rec = {"step": self.step, "loss": sum(window_loss) / len(window_loss),
                       "lr": self.scheduler.get_last_lr()[0],
                       "epoch": round(self.micro / self.micro_per_epoch, 4),
                       "tokens_per_s": round(window_tokens / max(now - window_t, 1e-9), 1)}
                self.records.append(rec)
                with open(log_path, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                window_loss, window_tokens, window_t = [], 0, now
            if self.step % cfg.save_steps == 0 and self.step < self.total_steps:
                self.save_checkpoint(self.out / f"checkpoint-{self.step}")
        bar.close()
        self.save_adapter(self.out)
        if cfg.plot_loss:
            plot_loss(self.losses, self.out / PLOT_FILE)
        return self.losses

    # -- checkpoints -------------------------------------------------------------------
    def save_adapter(self, folder: Path) -> None:
        tm, cfg = self.tm, self.cfg
        save_adapter(folder, tm.model, tm.peft_model, r=cfg.lora_rank, alpha=cfg.alpha, dropout=cfg.lora_dropout,
                     target_modules=tm.target_modules, expert_params=tm.expert_params,
                     base_model=str(cfg.resolve("model_name_or_path").resolve()))

    def save_checkpoint(self, folder: Path) -> None:
        self.save_adapter(folder)
        state = {
            "step": self.step, "micro": self.micro, "losses": self.losses, "records": self.records,
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "lora": {n: p.detach().clone() for n, p in self.tm.trainable()},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "config": {k: self.cfg.values[k] for k in RESUME_KEYS},
        }
        torch.save(state, folder / STATE_FILE)

    def resume(self, folder: Path) -> None:
        path = folder / STATE_FILE
        if not path.is_file():
            raise self.cfg.error("resume_from_checkpoint", f"{folder}: not a checkpoint (no {STATE_FILE})")
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # a truncated or foreign file
            raise self.cfg.error("resume_from_checkpoint", f"{path}: cannot read it ({str(e).splitlines()[0]})") \
                from None
        for k, v in state["config"].items():
            if self.cfg.values[k] != v:
                raise self.cfg.error(k, f"{self.cfg.values[k]!r} differs from {v!r} in the checkpoint {folder}")
        named = dict(self.tm.trainable())
        if set(named) != set(state["lora"]):
            raise self.cfg.error("resume_from_checkpoint", f"{folder}: its LoRA parameters are not this model's")
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(state["lora"][n])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.step, self.micro = state["step"], state["micro"]
        self.losses, self.records = list(state["losses"]), list(state["records"])
        self.log(f"resumed from {folder} at step {self.step}")


def latest_checkpoint(output_dir: Path) -> Path | None:
    cps = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()
           and (p / STATE_FILE).is_file()]
    return max(cps, key=lambda p: int(p.name.split("-")[-1])) if cps else None


def plot_loss(losses: list[float], path: Path) -> None:
    """The loss per step and its exponential moving average, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(losses) + 1))
    ema, smoothed = None, []
    for v in losses:
        ema = v if ema is None else 0.9 * ema + 0.1 * v
        smoothed.append(ema)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, alpha=0.4, label="loss")
    ax.plot(steps, smoothed, label="smoothed (EMA 0.9)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def has_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()
