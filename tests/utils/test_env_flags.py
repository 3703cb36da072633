"""The one rule every environment switch of the package is read with."""

from __future__ import annotations

import pytest

from mula_lightning.utils.env_flags import env_flag

NAME = "MULA_TEST_SWITCH"


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_gives_the_default(monkeypatch, default):
    """An unset or blank variable leaves the switch at its default, whichever that is."""
    monkeypatch.delenv(NAME, raising=False)
    assert env_flag(NAME, default) is default
    monkeypatch.setenv(NAME, "  ")
    assert env_flag(NAME, default) is default


@pytest.mark.parametrize("value", ["0", "false", "No", " OFF ", "00"])
def test_off_spellings(monkeypatch, value):
    """0, false, no and off (any case, spaces around) turn a switch that defaults to on off."""
    monkeypatch.setenv(NAME, value)
    assert env_flag(NAME, True) is False


@pytest.mark.parametrize("value", ["1", "TRUE", "yes", "on", "2"])
def test_on_spellings(monkeypatch, value):
    """1, true, yes, on and other non-zero integers turn a switch that defaults to off on."""
    monkeypatch.setenv(NAME, value)
    assert env_flag(NAME, False) is True


def test_anything_else_is_an_error_that_names_the_variable_and_value(monkeypatch):
    """A typo is refused with the variable and the value in the message, never read as on or off."""
    monkeypatch.setenv(NAME, "fasle")
    with pytest.raises(ValueError, match=r"MULA_TEST_SWITCH='fasle'"):
        env_flag(NAME, True)
