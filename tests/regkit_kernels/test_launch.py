"""What the Triton launchers share: the interpreter check and the power-of-2 block sizes."""

from regkit_kernels.launch import interpreter_on, pow2


def test_pow2_is_the_smallest_covering_power_of_two():
    assert [pow2(n) for n in (0, 1, 2, 3, 4, 5, 127, 128, 129)] == [1, 1, 2, 4, 4, 8, 128, 128, 256]


def test_interpreter_on_reads_the_environment_at_every_call(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_on()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreter_on()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not interpreter_on()
