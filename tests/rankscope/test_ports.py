"""Free ports are drawn below the kernel's ephemeral range, where no client connection takes them."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from rankscope.cli.stack.ports import DEFAULT_EPHEMERAL_LOW, LOWEST, ephemeral_low, free_port, is_free


def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    for _ in range(20):
        port = free_port()
        assert LOWEST <= port < ephemeral_low()
        assert is_free(port)


def test_a_taken_port_is_not_free_and_never_handed_out() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert not is_free(taken)

        class Drawn(random.Random):
            """Draws the taken port first, then ordinary ones."""
            first = True

            def randrange(self, *args: int) -> int:  # type: ignore[override]
                if self.first:
                    self.first = False
                    return int(taken)
                return super().randrange(*args)

        assert free_port(rng=Drawn(1)) != taken


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaulted(tmp_path: Path) -> None:
    good = tmp_path / "range"
    good.write_text("40000\t60999\n")
    assert ephemeral_low(good) == 40000
    bad = tmp_path / "bad"
    bad.write_text("")
    assert ephemeral_low(bad) == DEFAULT_EPHEMERAL_LOW
    assert ephemeral_low(tmp_path / "absent") == DEFAULT_EPHEMERAL_LOW
