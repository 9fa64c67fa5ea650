"""The ports the benchmarks' servers listen on stay clear of the kernel's ephemeral range, where any client socket may
be given one: a benchmark at +30000 once found 38082 held by a socket of the run before, and TorchServe failed to
bind it. handlers/serving/server.py's shifted_config warns when a shift reaches that range."""

from __future__ import annotations

import sys

import pytest

from benchmarks import e2e as bench_e2e
from benchmarks import e2e_tasks as bench_e2e_tasks
from benchmarks import overhead as bench_overhead
from benchmarks import restart as bench_restart
from handlers.serving import server as tsctl

LINUX_EPHEMERAL_START = 32768  # the kernel's default, where /proc does not say otherwise


def default_shift(module, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", [module.__file__])
    return module.parse_args().port_shift


@pytest.mark.parametrize("script", [bench_e2e, bench_e2e_tasks, bench_overhead, bench_restart])
def test_every_benchmark_server_listens_below_the_ephemeral_range(script, monkeypatch, tmp_path, capsys):
    shift = bench_restart.PORT_SHIFT if script is bench_restart else default_shift(script, monkeypatch)
    ports = tsctl.listening_ports(tsctl.shifted_config(tmp_path, shift).read_text())
    start = tsctl.ephemeral_ports() or LINUX_EPHEMERAL_START
    assert len(ports) == 5 and max(ports) < min(start, LINUX_EPHEMERAL_START), (shift, ports)
    assert "ephemeral" not in capsys.readouterr().out


def test_a_shift_into_the_ephemeral_range_is_warned_about(tmp_path, capsys):
    if tsctl.ephemeral_ports() is None:
        pytest.fail("no /proc/sys/net/ipv4/ip_local_port_range: this suite runs on Linux")
    tsctl.shifted_config(tmp_path, 30000)
    warning = capsys.readouterr().out
    assert "port 38082 is in the kernel's ephemeral range" in warning and "smaller port shift" in warning
