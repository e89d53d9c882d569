"""The trainer's settings: one dataclass, read from a TOML file and overridden by flags.

Every setting is a field of :class:`TrainConfig` whose metadata names its TOML table
(``[model]``, ``[data]``, ``[training]``, ``[parallel]``, ``[checkpoint]``,
``[output]``); the flag is the field's name with dashes (``n_layer`` -> ``--n-layer``).
Precedence, as torchtitan's: the defaults here, then ``--config file.toml``, then the
flags given on the command line. A key the file does not know is an error that names it,
as is a value of the wrong type, so a typo cannot silently train the default.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compose.config import ParallelConfig
from ..mesh import MeshShape
from .schedule import WarmupCosine

MODELS = ("gpt", "llama", "qwen2", "mistral", "gpt2")


def _opt(table: str, default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    """A setting: its default, the TOML table it lives in, and its help line."""
    return field(default=default, metadata={"table": table, "help": help, "choices": choices})


@dataclass
class TrainConfig:
    """Every setting of ``python -m pycomm.parallel.train`` (see ``--help`` for each one)."""

    # [model]: byte-level (vocabulary 256), or the --tokenizer's vocabulary
    model: str = _opt("model", "gpt", "gpt | llama | qwen2 | mistral | gpt2 (HuggingFace "
                      "models from a config, sized by the flags below) | hf:CONFIG.json")
    n_layer: int = _opt("model", 4, "transformer blocks")
    n_head: int = _opt("model", 4, "attention heads")
    n_embd: int = _opt("model", 128, "embedding width")
    block_size: int = _opt("model", 128, "context length in tokens (bytes without "
                           "--tokenizer)")
    dropout: float = _opt("model", 0.0, "dropout probability")
    tie_embeddings: bool = _opt("model", True, "the LM head shares the token embedding")
    vocab_multiple: int = _opt("model", 1, "with --tokenizer: the model's vocabulary is the "
                               "tokenizer's rounded up to a multiple of this (tp must "
                               "divide it; the extra ids never occur in the data)")
    from_pretrained: str = _opt("model", "", "a HuggingFace save_pretrained folder: the "
                                "model of its config.json, its safetensors weights read "
                                "by each rank for the pieces it holds (the model is built "
                                "on the meta device; --model is then this folder's)")
    init: str = _opt("model", "full", "full: every rank builds the whole model; meta: on "
                     "the meta device, each rank materializes only what it holds",
                     ("full", "meta"))
    moe_experts: int = _opt("model", 0, "--model gpt: every block's MLP a mixture of this "
                            "many experts (Mixtral's sparse block; 0: dense)")
    moe_top_k: int = _opt("model", 2, "with --moe-experts: the experts each token is routed to")
    moe_aux_coef: float = _opt("model", 0.01, "with --moe-experts: the load-balancing loss's "
                               "weight (0: none)")
    moe_capacity_factor: float = _opt("model", 0.0, "a mixture of experts' expert capacity "
                                      "(Megatron's): each expert takes ceil(tokens x k / E x "
                                      "factor) of a call's assignments, the rest dropped and "
                                      "counted (0: dropless)")
    moe_drop_policy: str = _opt("model", "probs", "over capacity, keep the highest routing "
                                "weights (probs) or the first tokens (position)",
                                ("probs", "position"))
    # [data]
    data: str = _opt("data", "", "a text file or a folder of them (default: the Python "
                     "standard library's .py sources)")
    val_fraction: float = _opt("data", 0.1, "the corpus's tail held out for validation")
    tokenizer: str = _opt("data", "", "a HuggingFace tokenizer (a hub name or a folder, as "
                          "AutoTokenizer.from_pretrained takes it) for --dataset; the model's "
                          "vocabulary is then the tokenizer's")
    dataset: str = _opt("data", "", "local files read with HuggingFace datasets (a .txt, "
                        ".jsonl or .json file, or a folder of them), tokenized by --tokenizer")
    text_field: str = _opt("data", "text", "the JSONL field holding a document's text")
    text_sample: str = _opt("data", "line", ".txt files: a document per line, per paragraph "
                            "(blank-line separated) or per file (datasets' sample_by)",
                            ("line", "paragraph", "document"))
    sft: bool = _opt("data", False, "JSONL records of prompt and response: only the "
                     "response is trained (the prompt's targets are -100); the default "
                     "when the records have both fields")
    pack: bool = _opt("data", False, "documents end to end in full rows, position_ids "
                      "restarting at each one (default: one document per row, padded)")
    batch_size: int = _opt("data", 16, "sequences per step (the global batch)")
    # [training]
    steps: int = _opt("training", 200, "optimizer steps")
    seed: int = _opt("training", 1337, "weights, batches and dropout all derive from it")
    lr: float = _opt("training", 1e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _opt("training", 0.1, "the cosine decays to lr * this")
    warmup_steps: int = _opt("training", 10, "linear warmup steps")
    weight_decay: float = _opt("training", 0.1, "AdamW weight decay (matrices only)")
    max_grad_norm: float = _opt("training", 1.0, "clip the global gradient norm (0: off)")
    eval_every: int = _opt("training", 50, "validate every K steps and at the end (0: off)")
    eval_batches: int = _opt("training", 4, "fixed held-out batches per validation")
    # [parallel]: mesh sizes, in (dp, tp, pp) order everywhere in the trainer
    dp: int = _opt("parallel", 1, "data-parallel replicas")
    tp: int = _opt("parallel", 1, "tensor-parallel ranks")
    pp: int = _opt("parallel", 1, "pipeline stages")
    ep: int = _opt("parallel", 1, "expert parallelism, drawn from dp (a mixture of experts' "
                   "experts split over ep ranks)")
    zero: int = _opt("parallel", 0, "ZeRO stage over dp", (0, 1, 2, 3))
    precision: str = _opt("parallel", "fp32", "compute dtype (fp32 master weights and "
                          "optimizer state either way; fp16 scales the loss)",
                          ("fp32", "bf16", "fp16"))
    bucket_mb: float = _opt("parallel", 25.0, "gradient bucket size in MB (C_B)")
    sequence_parallel: bool = _opt("parallel", False, "split activations along the "
                                   "sequence between TP layers")
    recompute: bool = _opt("parallel", False, "activation checkpointing of every block")
    compile: bool = _opt("parallel", False, "torch.compile each block in place (torchtitan's "
                         "per-block compilation)")
    partition_activations: bool = _opt("parallel", False, "P_a: each TP rank keeps 1/tp of "
                                       "a checkpointed block's input (needs recompute)")
    microbatches: int = _opt("parallel", 0, "pipeline micro-batches per step (0: pp)")
    schedule: str = _opt("parallel", "1f1b", "pipeline schedule", ("1f1b", "gpipe"))
    backend: str = _opt("parallel", "pycomm", "torch.distributed backend", ("pycomm", "gloo"))
    nproc: int = _opt("parallel", 0, "ranks to spawn here when not under torchrun "
                      "(0: dp * tp * pp)")
    threads: int = _opt("parallel", 1, "torch threads per rank (ranks share the cores; "
                        "more than the free cores makes every op spin)")
    offload: str = _opt("parallel", "none", "ZeRO-3 offload of each unit's shard, fp32 "
                        "master and Adam state: disk (files in --offload-dir) or cpu (host "
                        "memory); --zero 3 offloads whole units, --zero 1 or 2 the "
                        "optimizer state (ZeRO-Offload)",
                        ("none", "cpu", "disk"))
    offload_dir: str = _opt("parallel", "", "where --offload disk keeps one file per rank")
    offload_prefetch: int = _opt("parallel", 2, "units --offload reads ahead of use")
    max_live_mb: float = _opt("parallel", 0.0, "ZeRO-3's budget for gathered units and "
                              "gradients being reduced, MiB: prefetch held back and buffers "
                              "freed beyond it (0: none)")
    max_live_units: int = _opt("parallel", 0, "ZeRO-3's most units gathered at once by "
                               "prefetch (0: no bound)")
    max_unit_mb: float = _opt("parallel", 0.0, "ZeRO-3's largest unit, MiB of masters: a "
                              "larger embedding is split by rows and the head by vocabulary "
                              "chunks (the loss taken in them), each tile a unit (0: whole)")
    plan: str = _opt("parallel", "", "auto: train the layout python -m "
                     "pycomm.parallel.planner ranks first for nproc ranks (0: dp * tp * pp) "
                     "within --memory-gb; it sets dp, tp, pp, zero, recompute and "
                     "partition_activations", ("", "auto"))
    memory_gb: float = _opt("parallel", 0.0, "per-rank memory, GiB, beyond the runtime: "
                            "--plan auto's layout must fit in it (0: this machine's memory "
                            "over the ranks); without --plan auto, the layout given is "
                            "refused if predicted not to fit, and with --zero 3 --offload "
                            "its --offload-prefetch and --max-live-mb are picked to fit")
    plan_other_load: float = _opt("parallel", 0.0, "runnable processes beside the job that "
                                  "--plan auto counts as sharing its CPUs (e.g. the load "
                                  "average before it starts; 0: a machine of its own)")
    # [checkpoint]
    ckpt_dir: str = _opt("checkpoint", "", "where checkpoints go (step_<N> folders)")
    ckpt_every: int = _opt("checkpoint", 0, "save every K steps (0: never)")
    resume: bool = _opt("checkpoint", False, "continue from the last checkpoint in "
                        "ckpt_dir, in any layout")
    export_hf: str = _opt("checkpoint", "", "at the end, the model as a HuggingFace folder "
                          "(from_pretrained loads it; HuggingFace models only)")
    # [output]
    metrics: str = _opt("output", "", "JSON lines, one per step and per validation (rank 0)")
    plot: str = _opt("output", "", "loss curve PNG (default: the metrics file's name, .png)")
    progress: bool = _opt("output", True, "tqdm progress bar on rank 0")
    log_every: int = _opt("output", 10, "a line on the logger pycomm.parallel.train every K "
                          "steps (0: off)")
    tensorboard: str = _opt("output", "", "TensorBoard event files in this folder (rank 0; "
                            "pip install 'pycomm-collectives[tensorboard]')")

    @property
    def layout(self) -> MeshShape:
        return MeshShape(pp=self.pp, dp=self.dp, tp=self.tp, ep=self.ep)

    def effective_microbatches(self) -> int:
        return self.microbatches or self.pp

    def plot_path(self) -> str:
        if self.plot or not self.metrics:
            return self.plot
        return str(Path(self.metrics).with_suffix(".png"))

    def check(self) -> None:
        """Raises ValueError for settings the trainer cannot run, naming them."""
        self.layout  # noqa: B018 (MeshShape checks every dimension)
        _check_choices(self)
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "steps",
                     "eval_batches", "threads", "vocab_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"train: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"train: val_fraction must be in (0, 1), got {self.val_fraction}")
        rows = self.batch_size // self.dp
        if self.batch_size % self.dp or rows % self.effective_microbatches():
            raise ValueError(f"train: batch_size({self.batch_size}) must split into dp("
                             f"{self.dp}) replicas of microbatches("
                             f"{self.effective_microbatches()}) equal micro-batches")
        if (self.ckpt_every or self.resume) and not self.ckpt_dir:
            raise ValueError("train: ckpt_every and resume need ckpt_dir")
        if self.model not in MODELS and not self.model.startswith("hf:"):
            raise ValueError(f"train: model must be one of {MODELS} or hf:CONFIG.json, got "
                             f"{self.model!r}")
        if self.from_pretrained and self.model not in ("gpt", f"hf:{self.from_pretrained}"):
            raise ValueError(f"train: from_pretrained builds the model of "
                             f"{self.from_pretrained}/config.json; drop --model {self.model}")
        if self.export_hf and self.model == "gpt" and not self.from_pretrained:
            raise ValueError("train: export_hf writes a HuggingFace model; --model gpt is the "
                             "project's own (its checkpoints consolidate to a state dict)")
        if self.bucket_mb <= 0:
            raise ValueError(f"train: bucket_mb must be > 0, got {self.bucket_mb}")
        _check_data(self)
        _check_experts(self)
        for name in ("memory_gb", "plan_other_load", "log_every", "max_live_mb",
                     "max_live_units", "max_unit_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"train: {name} must be >= 0, got {getattr(self, name)}")


def _check_data(cfg: TrainConfig) -> None:
    """The byte corpus (--data) or a tokenized dataset (--dataset with --tokenizer), and
    the settings that only a dataset reads."""
    if bool(cfg.dataset) != bool(cfg.tokenizer):
        given, other = ("dataset", "tokenizer") if cfg.dataset else ("tokenizer", "dataset")
        raise ValueError(f"train: --{given} needs --{other} (a tokenized dataset takes "
                         "both; without them the trainer reads --data as bytes)")
    if cfg.dataset and cfg.data:
        raise ValueError("train: give --data (bytes) or --dataset (tokenized), not both")
    changed = [f"--{name.replace('_', '-')}" for name in ("sft", "pack", "text_field",
               "text_sample", "vocab_multiple") if getattr(cfg, name) != _fields()[name].default]
    if changed and not cfg.dataset:
        raise ValueError(f"train: {', '.join(changed)} given without --dataset, whose "
                         "settings they are (the byte-level --data is one stream, already "
                         "packed)")
    if cfg.tokenizer and cfg.plan == "auto":
        raise ValueError("train: --plan auto sizes byte-level models (vocabulary 256); with "
                         "--tokenizer give the layout (--dp, --tp, --pp) yourself")


def _check_experts(cfg: TrainConfig) -> None:
    """--moe-experts gives the project's GPT its experts; the other flags are its."""
    if not cfg.moe_experts:
        changed = [f"--{name.replace('_', '-')}" for name in ("moe_top_k", "moe_aux_coef")
                   if getattr(cfg, name) != _fields()[name].default]
        if changed:
            raise ValueError(f"train: {', '.join(changed)} given without --moe-experts (the "
                             "experts' settings)")
        if cfg.ep > 1 and cfg.model == "gpt" and not cfg.from_pretrained:
            raise ValueError(f"train: --ep {cfg.ep} splits a mixture of experts, and the GPT "
                             "has none without --moe-experts E")
        return
    if cfg.model != "gpt" or cfg.from_pretrained:
        raise ValueError(f"train: --moe-experts gives the project's GPT (--model gpt) its "
                         f"experts, not --model {cfg.model}"
                         f"{' --from-pretrained' if cfg.from_pretrained else ''}; a "
                         "HuggingFace mixture of experts comes from its config: --model "
                         "hf:CONFIG.json (e.g. examples/mixtral-tiny.json)")
    if cfg.moe_aux_coef and cfg.effective_microbatches() > 1 and cfg.schedule != "gpipe":
        raise ValueError(f"train: the experts' load-balancing loss counts the routing of the "
                         f"whole batch, and with {cfg.effective_microbatches()} micro-batches "
                         f"the {cfg.schedule} schedule starts a backward before the last "
                         "forward; give --schedule gpipe (or --moe-aux-coef 0)")
    if cfg.plan == "auto":
        raise ValueError("train: --plan auto times a dense GPT's blocks (the experts' "
                         "compute and activations are not calibrated); with --moe-experts "
                         "give the layout (--dp, --ep, --tp, --pp) yourself (python -m "
                         "pycomm.parallel.planner lists them with the experts' memory)")
    from ..models.gpt import GPTConfig

    try:
        GPTConfig(n_head=cfg.n_head, n_embd=cfg.n_embd, moe_experts=cfg.moe_experts,
                  moe_top_k=cfg.moe_top_k, moe_aux_coef=cfg.moe_aux_coef)
    except ValueError as err:
        raise ValueError(f"train: {err}") from None


def _check_choices(cfg: TrainConfig) -> None:
    for f in dataclasses.fields(cfg):
        choices = f.metadata["choices"]
        if choices and getattr(cfg, f.name) not in choices:
            raise ValueError(f"train: {f.name} must be one of {choices}, "
                             f"got {getattr(cfg, f.name)!r}")


TABLES = ("model", "data", "training", "parallel", "checkpoint", "output")


# -- reading: TOML, then flags -----------------------------------------------------------------


def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def _typed(value: Any, default: Any) -> tuple[Any, str]:
    """``value`` as the type of ``default``, or ``(None, what was expected)``."""
    kind = type(default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value), ""  # "lr = 1" in TOML is an int
    if type(value) is not kind:
        return None, f"must be {kind.__name__}, got {value!r} ({type(value).__name__})"
    return value, ""


def _toml() -> Any:
    """The TOML reader: the standard library's from Python 3.11, tomli before."""
    import importlib

    for name in ("tomllib", "tomli"):  # tomli: the same module, for Python 3.10
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    raise ImportError("train: --config needs Python >= 3.11 (tomllib) or pip install tomli")


def read_toml(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML file, by field name.

    Raises:
        ValueError: naming every unknown table or key, and every value of the wrong type.
    """
    with open(path, "rb") as stream:
        doc = _toml().load(stream)
    fields, out, unknown, wrong = _fields(), {}, [], []
    for table, body in doc.items():
        if table not in TABLES or not isinstance(body, dict):
            unknown.append(table)
            continue
        for key, value in body.items():
            f = fields.get(key)
            if f is None or f.metadata["table"] != table:
                unknown.append(f"{table}.{key}")
                continue
            out[key], problem = _typed(value, f.default)
            if problem:
                wrong.append(f"{table}.{key} {problem}")
    problems = [f"unknown keys {', '.join(unknown)} (the tables are "
                f"{', '.join(f'[{t}]' for t in TABLES)}; see --help)"] if unknown else []
    if problems or wrong:
        raise ValueError(f"train config {path}: {'; '.join(problems + wrong)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    """One flag per field; a flag not given is absent from the result (so the TOML
    file's value, or the default, stays)."""
    parser = argparse.ArgumentParser(
        prog="python -m pycomm.parallel.train", argument_default=argparse.SUPPRESS,
        description="Train a model (the project's GPT or a HuggingFace one) on bytes, or on "
                    "a tokenized dataset (--dataset, --tokenizer), on a (dp, tp, pp) mesh "
                    "with every strategy of parallel/. Flags override "
                    "--config's TOML keys ([table] key).")
    parser.add_argument("--config", help="TOML file of settings (flags override it)")
    groups = {t: parser.add_argument_group(f"[{t}]") for t in TABLES}
    for f in _fields().values():
        flag, table = "--" + f.name.replace("_", "-"), f.metadata["table"]
        help_text = f"{f.metadata['help']} (default: {f.default!r})"
        if isinstance(f.default, bool):
            groups[table].add_argument(flag, action=argparse.BooleanOptionalAction,
                                       help=help_text)
        else:
            groups[table].add_argument(flag, type=type(f.default), help=help_text,
                                       choices=f.metadata["choices"])
    return parser


def parse(argv: list[str] | None = None) -> TrainConfig:
    """Defaults, then ``--config``'s file, then the flags; checked."""
    given = vars(build_parser().parse_args(argv))
    path = given.pop("config", None)
    settings = read_toml(path) if path else {}
    settings.update(given)
    cfg = TrainConfig(**settings)
    cfg.check()
    return cfg


def parallel_config(cfg: TrainConfig) -> ParallelConfig:
    """The engine's settings for this job (what parallelize takes besides the mesh)."""
    return ParallelConfig(
        zero=cfg.zero, sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
        compile=cfg.compile,
        partition_activations=cfg.partition_activations,
        microbatches=cfg.effective_microbatches(), schedule=cfg.schedule,
        max_grad_norm=cfg.max_grad_norm or None, optimizer=torch.optim.AdamW,
        # fused: 3.6x the per-tensor loop on the host, as fast as DeepSpeed's CPU Adam
        # (records/offload/host-adam.md)
        optimizer_kwargs={"lr": cfg.lr, "betas": (0.9, 0.95), "fused": True},
        weight_decay=cfg.weight_decay, seed=cfg.seed, precision=cfg.precision,
        bucket_mb=cfg.bucket_mb,
        offload=cfg.offload, offload_dir=cfg.offload_dir,
        offload_prefetch=cfg.offload_prefetch,
        max_live_bytes=int(cfg.max_live_mb * 2**20) or None,
        max_live_units=cfg.max_live_units or None,
        max_unit_bytes=int(cfg.max_unit_mb * 2**20) or None,
        capacity_factor=cfg.moe_capacity_factor or None, drop_policy=cfg.moe_drop_policy,
        lr_lambda=WarmupCosine(cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio))
