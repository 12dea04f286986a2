"""Run a command as systemd's ``RestrictAddressFamilies=`` would: ``socket()`` of any
family not named fails with EAFNOSUPPORT (a seccomp filter, as systemd installs one).
``python address_families.py AF_UNIX,AF_INET -- COMMAND ...``; x86-64 only.

tests/test_deploy.py runs the daemons under the families their units name: libzmq
aborted the coordinator at its first tcp:// bind when netlink was missing."""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import sys

_SYS_SOCKET = 41  # x86-64
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
# classic BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_RET_K = 0x06
_NR_OFFSET = 0  # struct seccomp_data: nr, arch, instruction_pointer, args[6]
_ARG0_OFFSET = 16


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def restrict(families: list[int]) -> None:
    n = len(families)
    prog = [_insn(_LD_W_ABS, 0, 0, _NR_OFFSET), _insn(_JEQ_K, 0, n + 2, _SYS_SOCKET)]
    prog.append(_insn(_LD_W_ABS, 0, 0, _ARG0_OFFSET))
    for i, family in enumerate(families):  # a match jumps to the final ALLOW
        prog.append(_insn(_JEQ_K, n - i, 0, family))
    prog.append(_insn(_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT))
    prog.append(_insn(_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code, len(code))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def main() -> None:
    names, sep, command = sys.argv[1], sys.argv[2], sys.argv[3:]
    assert sep == "--" and command, __doc__
    restrict([getattr(socket, name) for name in names.split(",")])
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
