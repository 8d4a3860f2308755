"""Who this process is in the job: rank, local rank, world size and job id from the torchrun env."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from rankscope.config import Settings


@dataclass(frozen=True)
class RankIdentity:
    job: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int


def resolve_identity(settings: Settings, env: Mapping[str, str] | None = None) -> RankIdentity:
    """Settings override the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID).

    Without torchrun: rank 0 of 1, job id "local-<host>-<pid>".
    """
    env = os.environ if env is None else env
    host = socket.gethostname()
    pid = os.getpid()

    def pick(setting: int, name: str, default: int) -> int:
        if setting >= 0:
            return setting
        try:
            return int(env.get(name, default))
        except ValueError:
            return default

    rank = pick(settings.rank, "RANK", 0)
    local_rank = pick(settings.local_rank, "LOCAL_RANK", 0)
    world = pick(settings.world_size, "WORLD_SIZE", 1)
    job = settings.job_id or env.get("TORCHELASTIC_RUN_ID", "")
    if not job or job == "none":
        job = f"local-{host}-{env.get('MASTER_PORT', pid)}"
    return RankIdentity(job=job, rank=rank, local_rank=local_rank, world_size=world, host=host, pid=pid)
