"""benchmarks/command_buffer_log.py: XLA's command-buffer log lines, counted and timed per command buffer."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from command_buffer_log import call_mark_line, other_lines, summarize  # noqa: E402

# the lines as XLA's command_buffer_thunk.cc logs them at verbosity 3 (glog prefixes as TF_CPP writes them)
LOG = """\
I1205 20:15:18.000001  101 command_buffer_thunk.cc:83] Evict command buffer thunk command buffers; tracked thunks = 3
I1205 20:15:18.000002  101 command_buffer_thunk.cc:95] Evicted 2 command buffer thunk command buffers
I1205 20:15:18.100000  101 command_buffer_thunk.cc:170] Initialize command buffer on device #0 by recoding command \
buffer cmd sequence; num_commands=230
I1205 20:15:18.104000  101 command_buffer_thunk.cc:190] Initialized command buffer on device #0 in 4012 \u03bcs; \
num_commands=230
I1205 20:15:18.200000  101 command_buffer_thunk.cc:230] Executing warm up iteration of command buffer thunk
I1205 20:15:19.000000  101 command_buffer_thunk.cc:240] Update command buffer on device #0 by recoding command buffer \
cmd sequence after 1 executions since last update; num_commands=230; updated_allocs=8
I1205 20:15:19.001700  101 command_buffer_thunk.cc:260] Updated command buffer in 1682 \u03bcs; num_commands=230
I1205 20:15:19.001701  101 command_buffer_thunk.cc:265] Execute command buffer on device #0; num_executions=1
I1205 20:15:20.000000  101 command_buffer_thunk.cc:240] Update command buffer on device #0 by recoding command buffer \
cmd sequence after 1 executions since last update; num_commands=230; updated_allocs=8
I1205 20:15:20.002000  101 command_buffer_thunk.cc:260] Updated command buffer in 2000 \u03bcs; num_commands=230
I1205 20:15:20.100000  101 command_buffer_thunk.cc:240] Update command buffer on device #0 by recoding command buffer \
cmd sequence after 1 executions since last update; num_commands=26; updated_allocs=0
I1205 20:15:20.100040  101 command_buffer_thunk.cc:260] Updated command buffer in 38 \u03bcs; num_commands=26
something else entirely
"""


def test_updates_and_recordings_per_command_buffer():
    s = summarize(LOG.splitlines())
    big, small = s["buffers"]  # most commands first
    assert big == {"num_commands": 230, "updates": 2, "update_us_median": 1841.0, "update_us_max": 2000,
                   "updated_allocs": {8: 2}, "initializations": 1, "initialize_us_median": 4012}
    assert small["num_commands"] == 26 and small["updates"] == 1 and small["updated_allocs"] == {0: 1}
    assert small["initializations"] == 0 and small["initialize_us_median"] is None
    assert s["warmups"] == 1 and s["evicted"] == 2
    assert s["calls"] == {"marked": 0}  # no call marks in this log


def test_host_time_from_each_call_to_its_last_submission():
    ex = "command_buffer_thunk.cc:265] Execute command buffer on device #0; num_executions=1"
    t0 = time.mktime(time.strptime("2026-12-05 20:15:18", "%Y-%m-%d %H:%M:%S"))  # the marks as the benchmark writes
    lines = [call_mark_line(t0), f"I1205 20:15:18.001000  7 {ex}",
             f"I1205 20:15:18.004500  7 {ex}",  # the call's last submission: 4.5 ms after its start
             "I1205 20:15:18.700000  7 something else",
             call_mark_line(t0 + 1), f"I1205 20:15:19.002500  7 {ex}",
             call_mark_line(t0 + 2)]  # a call that submitted nothing (yet): not counted
    assert lines[0].startswith("I1205 20:15:18.000000 ")
    calls = summarize(lines)["calls"]
    assert calls["marked"] == 2
    assert calls["to_last_submit_ms_median"] == pytest.approx(3.5)
    assert calls["min"] == pytest.approx(2.5) and calls["max"] == pytest.approx(4.5)


def test_a_log_without_command_buffers():
    assert summarize(["I1205 nothing here", ""]) == {"buffers": [], "warmups": 0, "evicted": 0,
                                                     "calls": {"marked": 0}}


def test_other_lines_are_the_last_that_are_neither_buffers_nor_marks():
    lines = LOG.splitlines() + [call_mark_line(0.0), "E1205 20:15:19.000000  7 RESOURCE_EXHAUSTED: out of memory",
                                call_mark_line(1.0), "Traceback (most recent call last):"]
    assert other_lines(lines, 1) == ["Traceback (most recent call last):"]
    assert other_lines(lines, 5) == ["something else entirely",
                                     "E1205 20:15:19.000000  7 RESOURCE_EXHAUSTED: out of memory",
                                     "Traceback (most recent call last):"]
    assert other_lines(lines, 0) == []


# jax 0.11.2's XLA words them otherwise: the update's lines as in session 60's device log, the first recording's
# ("Recorded", is_first_record=1) as read in XLA's source
LOG_NEW = """\
I1206 03:00:00.000000  9 command_buffer_thunk.cc:301] [0] Create/Update command buffer by recoding command buffer \
cmd sequence after 0 executions since last update; num_commands=230; updated_allocs=40; is_first_record=1; \
needs_update=0
I1206 03:00:00.003000  9 command_buffer_thunk.cc:320] [0] Recorded command buffer in 3000 \u03bcs; num_commands=230
I1206 03:00:00.003001  9 command_buffer_thunk.cc:327] [0] Execute command buffer; num_executions=1
I1206 03:00:01.000000  9 command_buffer_thunk.cc:301] [0] Create/Update command buffer by recoding command buffer \
cmd sequence after 1 executions since last update; num_commands=230; updated_allocs=2; is_first_record=false; \
needs_update=true
I1206 03:00:01.001500  9 command_buffer_thunk.cc:320] [0] Updated command buffer in 1500 \u03bcs; num_commands=230
I1206 03:00:01.001501  9 command_buffer_thunk.cc:327] [0] Execute command buffer; num_executions=1
I1206 03:00:02.000000  9 command_buffer_thunk.cc:327] [0] Execute command buffer; num_executions=2
"""


def test_the_newer_wording():
    t0 = time.mktime(time.strptime("2026-12-06 03:00:01", "%Y-%m-%d %H:%M:%S"))
    lines = LOG_NEW.splitlines()
    lines.insert(3, call_mark_line(t0 - 0.0005))  # a call starting just before the update
    s = summarize(lines)
    (big,) = s["buffers"]
    assert big == {"num_commands": 230, "updates": 1, "update_us_median": 1500, "update_us_max": 1500,
                   "updated_allocs": {2: 1}, "initializations": 1, "initialize_us_median": 3000}
    # the marked call's last submission is the one at 03:00:02 (no later mark closes it)
    assert s["calls"]["marked"] == 1 and s["calls"]["to_last_submit_ms_median"] == pytest.approx(1000.5)
