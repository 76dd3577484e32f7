"""The point-to-point messages of band exchanges, among each split frame's ranks only.

[Note: one batch per phase] An exchange runs in phases. A rank posts all of a phase's sends and
receives, for every frame it holds a band of, as one batch (``collectives.send_receive``), then
waits for all of them, so two ranks that share bands of two frames never wait on each other in
opposite orders. Within a batch the messages are ordered by frame id, then message (channel),
then peer in band order, and each carries the tag ``CHANNELS * frame + channel``: both ends of
a pair post their messages in the same order (what NCCL matches on) under the same tags (what
gloo matches on). A rank with no band of a split frame posts nothing: per-layer traffic stays
among a frame's ranks, and the lockstep that holds is each pair's.
"""

import torch
import torch.distributed as dist

from fx_vitbal.runtime.transport import collectives

# Message channels of one frame within one phase: a ring's key/value block and its gradient
# accumulator can go to the same peer in the same phase.
CHANNELS = 2
KV, ACC = 0, 1


class Phase:
    """The sends and receives of one phase for all frames, posted as one batch; callers add
    them in frame order ([Note: one batch per phase])."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.messages: list[tuple[bool, torch.Tensor, int, int]] = []
        self.works: list = []

    def send(self, tensor: torch.Tensor, peer: int, frame: int, channel: int = KV) -> None:
        self.messages.append((True, tensor.contiguous(), peer, CHANNELS * frame + channel))

    def recv(
        self, shape, like: torch.Tensor, peer: int, frame: int, channel: int = KV
    ) -> torch.Tensor:
        buffer = like.new_empty(shape)
        self.messages.append((False, buffer, peer, CHANNELS * frame + channel))
        return buffer

    def start(self) -> "Phase":
        self.works = collectives.send_receive(self.messages, self.group)
        return self

    def wait(self) -> None:
        for work in self.works:
            work.wait()
