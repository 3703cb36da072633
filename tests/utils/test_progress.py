"""The progress line's arithmetic and format (:mod:`mula_lightning.utils.progress`): cadence, content, rates over
the interval, values read only on printing steps, nothing from a disabled meter."""

import io
import re

import pytest

from mula_lightning.utils.progress import ProgressMeter, format_duration, format_rate


def test_lines_come_every_n_steps_and_at_the_end_with_every_field():
    """10 steps at every 3: lines at steps 3, 6 and 9 and a last one at 10 (not twice at a printed step); each has
    the step of the total, the metrics, tokens per second over the replicas and per device, MFU with a peak, the
    memory, the time per step and the time left."""
    out = io.StringIO()
    meter = ProgressMeter(max_steps=10, every_n_steps=3, world_size=4, peak_tflops=1e-6, flops_per_token=6.0,
                          stream=out)  # fmt: skip
    for step in range(1, 11):
        meter.add_tokens(1000)
        meter.step(step, loss=2.5, aux=0.01, lr=3e-4)
    meter.finish(10, loss=2.4)
    assert meter.finish(10, loss=2.4) is None  # the end was printed
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 3/10", "step 6/10", "step 9/10", "step 10/10"]
    first = lines[0].split(" | ")
    assert first[1:4] == ["loss 2.5000", "aux 0.0100", "lr 3.00e-04"]
    assert re.fullmatch(r"[\d.]+[kMG]? tok/s \([\d.]+[kMG]?/device\)", first[4]), first[4]
    assert first[5].startswith("MFU ") and first[5].endswith("%")
    assert first[6].startswith("mem ") and first[6].endswith(" GiB host")
    assert first[7].endswith(" s/step") and first[8].startswith("left ")
    assert "left" not in lines[-1]  # nothing left at the last step
    assert meter.lines == lines


def test_rates_are_those_of_the_interval():
    """Tokens and time count from the previous line: 3 steps of 1000 tokens over a measured span give that rate;
    per device is the rate over the world size; MFU is the rate x FLOPs per token over the peak of the world."""
    meter = ProgressMeter(max_steps=None, every_n_steps=3, world_size=2, peak_tflops=1.0, flops_per_token=1e9,
                          stream=io.StringIO())  # fmt: skip
    meter._since_time -= 1.0  # the interval began 1 s ago (plus the few microseconds this test takes)
    for step in (1, 2, 3):
        meter.add_tokens(1000)
        meter.step(step)
    fields = meter.lines[0].split(" | ")
    assert fields[0] == "step 3"  # no total known: no "of", no time left
    rate = float(fields[1].split("k tok/s")[0]) * 1e3
    assert rate == pytest.approx(3000, rel=0.01)
    per_device = float(fields[1].split("(")[1].split("k/device")[0]) * 1e3
    assert per_device == pytest.approx(rate / 2, rel=0.01)
    mfu = float(fields[2].removeprefix("MFU ").removesuffix("%"))
    assert mfu == pytest.approx(100 * 3000 * 1e9 / 2e12, rel=0.02)
    assert not any(f.startswith("left") for f in fields)


def test_values_are_read_on_printing_steps_only_and_a_disabled_meter_prints_nothing():
    """A metric given as a callable (a device value read back to the host) is called on the printing steps only;
    a meter of another rank (disabled) prints nothing and reads nothing; every_n_steps 0 prints the end only."""
    reads = []
    meter = ProgressMeter(max_steps=6, every_n_steps=2, stream=io.StringIO())
    other = ProgressMeter(max_steps=6, every_n_steps=2, enabled=False, stream=io.StringIO())
    quiet = ProgressMeter(max_steps=6, every_n_steps=0, stream=io.StringIO())
    for step in range(1, 7):
        for m in (meter, other, quiet):
            m.step(step, loss=lambda step=step: reads.append(step) or 1.0)
    assert reads == [2, 4, 6]
    assert other.lines == [] and other.finish(6, loss=1.0) is None
    assert quiet.lines == [] and quiet.finish(6, loss=lambda: reads.append("end") or 1.0).startswith("step 6/6")
    with pytest.raises(ValueError, match=r"every_n_steps \(-1\)"):
        ProgressMeter(max_steps=6, every_n_steps=-1)


def test_durations_and_rates_read_as_people_write_them():
    """Seconds with a decimal under a minute, then minutes and seconds, hours and minutes, days and hours; rates
    with three significant figures and k / M / G."""
    assert [format_duration(s) for s in (4.24, 130, 3 * 3600 + 300, 3 * 86400 + 7200)] == ["4.2s", "2m10s", "3h05m",
                                                                                             "3d02h"]  # fmt: skip
    assert [format_rate(v) for v in (950, 12345, 4.56e6, 2.5e9)] == ["950", "12.3k", "4.56M", "2.5G"]
