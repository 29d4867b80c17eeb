"""The bed's choice of QEMU accelerator: KVM is tried only where the CPU offers virtualization
and ``/dev/kvm`` opens (``tests/testbed/vm.py``); the probe boot decides the rest."""

from __future__ import annotations

import pytest

from tests.testbed.vm import kvm_possible

INTEL = "processor\t: 0\nflags\t\t: fpu vme de pse vmx sse2\n\nprocessor\t: 1\nflags\t\t: fpu vmx\n"
AMD = "processor\t: 0\nflags\t\t: fpu svm sse2\n"
# a guest without nested virtualization: /dev/kvm may exist, the CPU offers neither
NESTED_OFF = "processor\t: 0\nflags\t\t: fpu vme de pse sse2 hypervisor\n"


@pytest.mark.parametrize(
    ("cpuinfo", "opens", "expected"),
    [
        (INTEL, True, True),
        (AMD, True, True),
        (NESTED_OFF, True, False),
        (INTEL, False, False),
        ("", True, False),
        ("flags: vmxx svmm\n", True, False),  # whole words only
    ],
)
def test_kvm_is_tried_only_with_virtualization_and_an_open_device(
    cpuinfo: str, opens: bool, expected: bool
) -> None:
    assert kvm_possible(cpuinfo, opens) is expected
