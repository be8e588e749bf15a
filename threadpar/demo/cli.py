"""`python -m threadpar.demo` command line: flags, defaults, and the checks that make bad combinations
fail before any thread starts, with a message that says what to pass instead."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

from threadpar.errors import ConfigError
from threadpar.models.gpt import MODEL_SIZES
from threadpar.parallel.context_parallel import padding_multiple
from threadpar.pipeline.schedule import default_chunks_per_rank
from threadpar.runtime.rank_cores import ALL, check_rank_cores
from threadpar.topology import Layout

SCHEDULES = ("afab", "1f1b", "interleaved", "zbh1", "zb_interleaved", "zbv")
DTYPES = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2)


def default_layout(n: int, ep: int = 1) -> tuple[int, int, int]:
    """(dp, tp, pp) for n ranks: use all three axes when n allows (8 -> 2 x 2 x 2), TP first, then PP;
    with expert parallelism, give up PP, then TP, until dp is a multiple of ep (4 ranks, ep 2 -> 2 x 2 x 1)."""
    tp = 2 if n % 2 == 0 else 1
    pp = 2 if (n // tp) % 2 == 0 else 1
    while (n // (tp * pp)) % ep and tp * pp > 1:
        pp, tp = (1, tp) if pp > 1 else (pp, 1)
    return n // (tp * pp), tp, pp


@dataclass(kw_only=True)
class DemoConfig:
    gpus: int = 8  # ranks in each process
    processes: int = 1  # not a flag: the number of processes torchrun started (threadpar.process_env())
    dp: int | None = None
    cp: int = 1
    tp: int | None = None
    pp: int | None = None
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float | None = None  # None: dropless; else each expert takes at most its capacity
    ep: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None
    steps: int = 100
    model: str = "tiny"
    seq_len: int = 64
    batch_size: int = 32
    lr: float = 2e-2
    clip_grad: float = 1.0  # the whole model's gradient norm is clipped to this; 0: no clipping
    dtype: str = "fp32"
    seed: int = 0
    data: Path | None = None
    out: Path | None = Path("out/demo")
    checkpoint: Path | None = None
    resume: bool = False
    check: bool = False
    recompute: bool = False
    sequence_parallel: bool = False
    zero: int = 0  # distributed optimizer: 0 off, 1 shards optimizer state, 2 also the reduced gradients
    compile: str | None = None  # a torch.compile backend for every transformer block; None: eager
    cuda_graphs: bool = False  # capture each rank's step once as a CUDA graph and replay it (graphed_step)
    rank_cores: int | str | None = None  # LaunchConfig.rank_cores: None (auto), "all" or a number of cores
    log_every: int = 1
    # The library's Layout of the sizes above (dp, tp, pp derived when not given), over all ranks.
    layout: Layout = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"--gpus {self.gpus}: need at least 1")
        if self.processes < 1:
            raise ConfigError(f"processes={self.processes}: need at least 1")
        self._derive_layout()
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.zero not in ZERO_STAGES:
            raise ConfigError(
                f"--zero {self.zero!r}: choose 0 (off), 1 (shard optimizer state) or 2 (and gradients)"
            )
        if self.compile is not None:
            self._check_compile_backend()
        check_rank_cores(self.rank_cores)
        if self.model not in MODEL_SIZES:
            raise ConfigError(f"--model {self.model!r}: choose one of {', '.join(MODEL_SIZES)}")
        if self.microbatches is None:
            self.microbatches = 2 * self.layout.pp if self.layout.pp > 1 else 1
        dp = self.layout.dp
        per_replica = self.batch_size // dp if self.batch_size % dp == 0 else None
        if per_replica is None:
            raise ConfigError(f"--batch-size {self.batch_size} must be divisible by dp={dp}")
        if per_replica % self.microbatches:
            raise ConfigError(
                f"each data-parallel replica gets {per_replica} sequences, which do not split into "
                f"--microbatches {self.microbatches}; choose a batch size divisible by dp*microbatches = "
                f"{dp * self.microbatches}"
            )
        if not self.clip_grad >= 0:
            raise ConfigError(
                f"--clip-grad {self.clip_grad}: the largest gradient norm, >= 0 (0 disables clipping)"
            )
        for name in ("steps", "seq_len", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.resume and self.checkpoint is None:
            raise ConfigError("--resume needs --checkpoint DIR (where the checkpoint to resume from is)")
        self._check_sequence_split()
        self._check_experts()
        self._check_cuda_graphs()

    def _derive_layout(self) -> None:
        """dp, tp, pp from the flags given: all three left out -> default_layout of the ranks per CP rank;
        otherwise the library's Layout.build derives dp and checks the sizes."""
        ranks = self.world_size
        if not isinstance(self.cp, int) or self.cp < 1 or ranks % self.cp:
            raise ConfigError(f"--cp {self.cp}: must be a positive divisor of {self._ranks_text()}")
        if all(s is None for s in (self.dp, self.tp, self.pp)):
            self.dp, self.tp, self.pp = default_layout(ranks // self.cp, self.ep if self.moe_experts else 1)
        try:
            layout = Layout.build(ranks, dp=self.dp, tp=self.tp or 1, pp=self.pp or 1, cp=self.cp)
        except ConfigError as error:
            sizes = {"dp": self.dp, "cp": self.cp if self.cp > 1 else None, "tp": self.tp, "pp": self.pp}
            given = [f"--{name} {size}" for name, size in sizes.items() if size is not None]
            raise ConfigError(f"{self._ranks_text()} with {' '.join(given)}: {error}") from None
        self.layout = layout
        self.dp, self.tp, self.pp = layout.dp, layout.tp, layout.pp

    def _check_compile_backend(self) -> None:
        import torch._dynamo  # (slow to import: only for --compile)

        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.compile not in backends:
            raise ConfigError(
                f"--compile {self.compile!r}: choose a torch.compile backend: {', '.join(backends)}"
            )

    def _check_sequence_split(self) -> None:
        """Context (and sequence) parallelism split each sequence into equal parts."""
        tp = self.layout.tp
        multiple = padding_multiple(self.cp, tp, self.sequence_parallel)
        if self.seq_len % multiple:
            parts = [f"cp={self.cp} (two chunks per CP rank)"] if self.cp > 1 else []
            if self.sequence_parallel and tp > 1:
                parts.append(f"tp={tp} (--sequence-parallel)")
            raise ConfigError(
                f"--seq-len {self.seq_len} does not split over {' x '.join(parts)}: it must be a multiple of "
                f"{multiple}; choose --seq-len {multiple * max(1, round(self.seq_len / multiple))}"
            )

    def _check_experts(self) -> None:
        if not isinstance(self.moe_experts, int) or self.moe_experts < 0:
            raise ConfigError(
                f"--moe-experts {self.moe_experts}: must be 0 (dense MLPs) or a positive number"
            )
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"--ep {self.ep}: must be a positive int")
        if self.ep > 1 and not self.moe_experts:
            raise ConfigError(
                f"--ep {self.ep} shards the experts of MoE blocks; add --moe-experts N (a multiple of {self.ep})"
            )
        if not self.moe_experts:
            return
        factor = self.moe_capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0
        ):
            raise ConfigError(
                f"--moe-capacity-factor {factor}: must be a positive number (or left out: dropless)"
            )
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ConfigError(
                f"--moe-top-k {self.moe_top_k}: each token goes to between 1 and --moe-experts "
                f"{self.moe_experts} experts"
            )
        if self.layout.dp % self.ep:
            raise ConfigError(
                f"--ep {self.ep} must divide dp={self.dp}: the experts are split over ep of the data-parallel "
                f"replicas; choose a layout whose dp is a multiple of {self.ep} (e.g. --dp {self.ep})"
            )
        if self.moe_experts % self.ep:
            raise ConfigError(
                f"--moe-experts {self.moe_experts} does not split over --ep {self.ep}; choose a multiple of {self.ep}"
            )

    def _check_cuda_graphs(self) -> None:
        """What a graphed step cannot hold yet (threadpar.cuda_graphs.step)."""
        if not self.cuda_graphs:
            return
        reasons = []
        if self.moe_experts and self.moe_capacity_factor is None:
            reasons.append(
                "--moe-experts without --moe-capacity-factor (dropless routing gives each step its own shapes): "
                "add e.g. --moe-capacity-factor 1.25, and each expert's rows are padded to that capacity"
            )
        if reasons:
            raise ConfigError("--cuda-graphs cannot graph this run: " + "; ".join(reasons))

    @property
    def world_size(self) -> int:
        """Ranks in all: --gpus rank threads in each of the processes torchrun started."""
        return self.gpus * self.processes

    def _ranks_text(self) -> str:
        if self.processes == 1:
            return f"--gpus {self.gpus}"
        return f"--gpus {self.gpus} x {self.processes} processes = {self.world_size} ranks"

    @property
    def chunks_per_stage(self) -> int:
        return default_chunks_per_rank(self.schedule)


def parse_args(argv: list[str] | None = None, processes: int = 1) -> DemoConfig:
    """The flags in `argv`; `processes`: how many processes run the demo (each with --gpus ranks)."""
    defaults = DemoConfig(gpus=8)
    p = argparse.ArgumentParser(
        prog="python -m threadpar.demo",
        description="Train a small GPT with DP x CP x TP x PP (MoE experts over EP) on rank threads (GPUs, "
        "or CPU threads without them).",
        epilog="Under torchrun each process runs --gpus rank threads and the layout spans all processes: "
        "torchrun --standalone --nproc-per-node 2 -m threadpar.demo --gpus 2 trains on 4 ranks. "
        "Process 0 prints and writes --out and --checkpoint.",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=8,
        help="ranks (GPUs, or CPU threads) in this process; under torchrun, in each process",
    )
    p.add_argument("--dp", type=int, help="data-parallel size (default: derived)")
    p.add_argument(
        "--cp", type=int, default=1, help="context-parallel size: each sequence split over cp ranks"
    )
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: 2 when it divides --gpus)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (default: 2 when it divides what is left)")
    p.add_argument("--schedule", choices=SCHEDULES, default=defaults.schedule)
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: 2 x pp)")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default=defaults.model)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global batch, in sequences")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument(
        "--clip-grad",
        type=float,
        default=defaults.clip_grad,
        metavar="NORM",
        help="clip the whole model's gradient norm to NORM (default 1.0; 0: no clipping)",
    )
    p.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--data", type=Path, help="a text file; its bytes are the tokens (default: synthetic corpus)"
    )
    p.add_argument("--out", type=Path, default=defaults.out, help="where plots, trace and metrics go")
    p.add_argument("--checkpoint", type=Path, help="directory to save the checkpoint in (and resume from)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint")
    p.add_argument("--check", action="store_true", help="also run the single-thread model and compare losses")
    p.add_argument("--recompute", action="store_true", help="recompute each block's activations in backward")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture each rank's step as a CUDA graph after 3 eager steps and replay it (nccl backend)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="shard norms/dropout along the sequence")
    p.add_argument("--moe-experts", type=int, default=0, help="make each MLP a mixture of N experts")
    p.add_argument("--moe-top-k", type=int, default=defaults.moe_top_k, help="experts per token")
    p.add_argument(
        "--moe-capacity-factor",
        type=float,
        default=None,
        help="each expert keeps at most factor x tokens x top-k / experts assignments (default: dropless)",
    )
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size: experts split over ep DP ranks")
    p.add_argument(
        "--zero",
        type=int,
        choices=ZERO_STAGES,
        default=0,
        help="distributed optimizer over DP: 1 shards AdamW's state, 2 also the reduced gradients (ZeRO-1/2)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="torch.compile every transformer block (default backend inductor; aot_eager compiles fastest)",
    )
    p.add_argument(
        "--rank-cores",
        type=_rank_cores,
        metavar="N|all",
        help="CPU cores each process's rank threads share (default: one on CPU, unpinned on GPUs; 'all' "
        "for heavy CPU math); LaunchConfig.rank_cores",
    )
    p.add_argument("--log-every", type=int, default=defaults.log_every)
    args = p.parse_args(argv)
    names = {f.name for f in fields(DemoConfig)}
    return DemoConfig(processes=processes, **{k: v for k, v in vars(args).items() if k in names})


def _rank_cores(text: str) -> int | str:
    if text == ALL:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of cores or 'all'") from None
