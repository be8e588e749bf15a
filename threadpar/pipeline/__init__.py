"""Pipeline parallelism: stage partition, schedules as data, their lowering, a simulator, thread P2P, the
executor (an interpreter of lowered plans), timelines.

from threadpar.pipeline import PipelineParallel, build_chunks

def train():
    stage, pp = threadpar.get_coords().pp, threadpar.get_layout().pp
    chunks = build_chunks(layers, pp_size=pp, pp_rank=stage, first=embedding, last=head)
    pipe = PipelineParallel(chunks, loss_fn=F.cross_entropy, schedule="1f1b", num_microbatches=8)
    loss = pipe.train_step(inputs, targets)  # the mean loss, on every stage

threadpar.launch(train, world_size=4, pp=4)
"""

from threadpar.pipeline.chunks import build_chunks
from threadpar.pipeline.executor import PipelineParallel
from threadpar.pipeline.lowering import lower
from threadpar.pipeline.p2p import (
    Link,
    describe_tag,
    message_tag,
    recv_activation,
    send_activation,
    settle_gradient,
)
from threadpar.pipeline.partition import StageInfo, chunk_layer_ranges, get_stage_info
from threadpar.pipeline.schedule import (
    SCHEDULES,
    Action,
    Plan,
    ScheduleError,
    afab,
    build_plan,
    default_chunks_per_rank,
    interleaved_1f1b,
    one_f_one_b,
    schedule_placement,
    zb_interleaved,
    zbh1,
    zbv,
)
from threadpar.pipeline.simulator import Simulation, awaiting_weight_peaks, in_flight_peaks, simulate
from threadpar.pipeline.timeline import (
    Event,
    Timeline,
    chrome_trace,
    measured_bubble,
    step_time,
    write_chrome_trace,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Event",
    "Link",
    "PipelineParallel",
    "Plan",
    "ScheduleError",
    "Simulation",
    "StageInfo",
    "Timeline",
    "afab",
    "awaiting_weight_peaks",
    "build_chunks",
    "build_plan",
    "chrome_trace",
    "chunk_layer_ranges",
    "default_chunks_per_rank",
    "describe_tag",
    "get_stage_info",
    "in_flight_peaks",
    "interleaved_1f1b",
    "lower",
    "measured_bubble",
    "message_tag",
    "one_f_one_b",
    "recv_activation",
    "schedule_placement",
    "send_activation",
    "settle_gradient",
    "simulate",
    "step_time",
    "write_chrome_trace",
    "zb_interleaved",
    "zbh1",
    "zbv",
]
