"""The one system-call policy of every sandbox, for bwrap (compiled BPF) and Docker (a profile).

An allow-list modelled on Docker's default profile for a process with no capabilities, and
stricter: no io_uring (a large attack surface of its own, which Docker's older profiles allow),
no ptrace, process_vm_readv/writev or kcmp, no modify_ldt. Everything not listed fails with
EPERM: mount and umount, unshare, setns and clone with namespace flags, bpf, perf_event_open,
userfaultfd, the keyring (add_key, request_key, keyctl), module loading, kexec, reboot, clock
setting, swap, quotactl, syslog. clone3 fails with ENOSYS so that the C library falls back to
clone, whose flags can be checked. The kernel's own code (ipykernel, numpy, pandas, matplotlib,
threads, subprocesses) needs nothing more.
"""

from __future__ import annotations

import errno
import functools
import json
import tempfile
from dataclasses import dataclass
from typing import Any, Literal

# Every namespace flag clone accepts (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
CLONE_NAMESPACE_FLAGS = 0x7E020000
AF_VSOCK = 40
# Linux's own personality, with or without its harmless flags, and the query for the current one.
_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

ALLOWED = (
    "accept", "accept4", "access", "adjtimex", "alarm", "arch_prctl", "bind", "brk", "capget",
    "capset", "chdir", "chmod", "chown", "chown32", "clock_adjtime", "clock_adjtime64",
    "clock_getres", "clock_getres_time64", "clock_gettime", "clock_gettime64", "clock_nanosleep",
    "clock_nanosleep_time64", "close", "close_range", "connect", "copy_file_range", "creat", "dup",
    "dup2", "dup3", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait",
    "epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2", "execve", "execveat",
    "exit", "exit_group", "faccessat", "faccessat2", "fadvise64", "fadvise64_64", "fallocate",
    "fanotify_mark", "fchdir", "fchmod", "fchmodat", "fchown", "fchown32", "fchownat", "fcntl",
    "fcntl64", "fdatasync", "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr",
    "fsetxattr", "fstat", "fstat64", "fstatat64", "fstatfs", "fstatfs64", "fsync", "ftruncate",
    "ftruncate64", "futex", "futex_time64", "futex_waitv", "futimesat", "getcpu", "getcwd",
    "getdents", "getdents64", "getegid", "getegid32", "geteuid", "geteuid32", "getgid",
    "getgid32", "getgroups", "getgroups32", "getitimer", "getpeername", "getpgid", "getpgrp",
    "getpid", "getppid", "getpriority", "getrandom", "getresgid", "getresgid32", "getresuid",
    "getresuid32", "getrlimit", "get_robust_list", "getrusage", "getsid", "getsockname",
    "getsockopt", "get_thread_area", "gettid", "gettimeofday", "getuid", "getuid32", "getxattr",
    "inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch", "io_cancel", "ioctl",
    "io_destroy", "io_getevents", "io_pgetevents", "io_pgetevents_time64", "ioprio_get",
    "ioprio_set", "io_setup", "io_submit", "ipc", "kill", "landlock_add_rule",
    "landlock_create_ruleset", "landlock_restrict_self", "lchown", "lchown32", "lgetxattr", "link",
    "linkat", "listen", "listxattr", "llistxattr", "_llseek", "lremovexattr", "lseek", "lsetxattr",
    "lstat", "lstat64", "madvise", "membarrier", "memfd_create", "mincore", "mkdir", "mkdirat",
    "mknod", "mknodat", "mlock", "mlock2", "mlockall", "mmap", "mmap2", "mprotect",
    "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedreceive_time64",
    "mq_timedsend", "mq_timedsend_time64", "mq_unlink", "mremap", "msgctl", "msgget", "msgrcv",
    "msgsnd", "msync", "munlock", "munlockall", "munmap", "name_to_handle_at", "nanosleep",
    "newfstatat", "_newselect", "open", "openat", "openat2", "pause", "pidfd_open",
    "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc", "pkey_free", "pkey_mprotect", "poll",
    "ppoll", "ppoll_time64", "prctl", "pread64", "preadv", "preadv2", "prlimit64",
    "process_mrelease", "pselect6", "pselect6_time64", "pwrite64", "pwritev", "pwritev2", "read",
    "readahead", "readlink", "readlinkat", "readv", "recv", "recvfrom", "recvmmsg",
    "recvmmsg_time64", "recvmsg", "remap_file_pages", "removexattr", "rename", "renameat",
    "renameat2", "restart_syscall", "rmdir", "rseq", "rt_sigaction", "rt_sigpending",
    "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
    "rt_sigtimedwait_time64", "rt_tgsigqueueinfo", "sched_getaffinity", "sched_getattr",
    "sched_getparam", "sched_get_priority_max", "sched_get_priority_min", "sched_getscheduler",
    "sched_rr_get_interval", "sched_rr_get_interval_time64", "sched_setaffinity", "sched_setattr",
    "sched_setparam", "sched_setscheduler", "sched_yield", "seccomp", "select", "semctl",
    "semget", "semop", "semtimedop", "semtimedop_time64", "send", "sendfile", "sendfile64",
    "sendmmsg", "sendmsg", "sendto", "setfsgid", "setfsgid32", "setfsuid", "setfsuid32", "setgid",
    "setgid32", "setgroups", "setgroups32", "setitimer", "setpgid", "setpriority", "setregid",
    "setregid32", "setresgid", "setresgid32", "setresuid", "setresuid32", "setreuid",
    "setreuid32", "setrlimit", "set_robust_list", "setsid", "setsockopt", "set_thread_area",
    "set_tid_address", "setuid", "setuid32", "setxattr", "shmat", "shmctl", "shmdt", "shmget",
    "shutdown", "sigaltstack", "signalfd", "signalfd4", "sigprocmask", "sigreturn", "socketcall",
    "socketpair", "splice", "stat", "stat64", "statfs", "statfs64", "statx", "symlink",
    "symlinkat", "sync", "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill", "time",
    "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime", "timer_gettime64",
    "timer_settime", "timer_settime64", "timerfd_create", "timerfd_gettime", "timerfd_gettime64",
    "timerfd_settime", "timerfd_settime64", "times", "tkill", "truncate", "truncate64",
    "ugetrlimit", "umask", "uname", "unlink", "unlinkat", "utime", "utimensat",
    "utimensat_time64", "utimes", "vfork", "vmsplice", "wait4", "waitid", "waitpid", "write",
    "writev",
)  # fmt: skip

Op = Literal["eq", "ne", "masked_eq"]


@dataclass(frozen=True)
class ArgCheck:
    """Argument `index` compared with `value` (for masked_eq: `arg & value == 0`)."""

    index: int
    op: Op
    value: int


@dataclass(frozen=True)
class Rule:
    """Calls to `name` (with `check`, if any) are allowed, or fail with `errno`."""

    name: str
    check: ArgCheck | None = None
    errno: int | None = None


RULES: tuple[Rule, ...] = (
    *(Rule(name) for name in ALLOWED),
    Rule("socket", ArgCheck(0, "ne", AF_VSOCK)),  # no channel to a hypervisor
    Rule("clone", ArgCheck(0, "masked_eq", CLONE_NAMESPACE_FLAGS)),  # threads, forks: no namespaces
    Rule("clone3", errno=errno.ENOSYS),  # its flags are out of reach: make the C library use clone
    *(Rule("personality", ArgCheck(0, "eq", p)) for p in _PERSONALITIES),
)
DEFAULT_ERRNO = errno.EPERM

_DOCKER_OPS = {"eq": "SCMP_CMP_EQ", "ne": "SCMP_CMP_NE", "masked_eq": "SCMP_CMP_MASKED_EQ"}


@functools.cache
def docker_profile() -> str:
    """The policy as a Docker seccomp profile (JSON), for `security_opt=["seccomp=..."]`."""
    syscalls: list[dict[str, Any]] = []
    for rule in RULES:
        entry: dict[str, Any] = {"names": [rule.name], "action": "SCMP_ACT_ALLOW"}
        if rule.errno is not None:
            entry = {"names": [rule.name], "action": "SCMP_ACT_ERRNO", "errnoRet": rule.errno}
        if rule.check is not None:
            arg: dict[str, Any] = {"index": rule.check.index, "op": _DOCKER_OPS[rule.check.op]}
            # Docker's masked_eq: value is the mask, valueTwo what the masked argument must be.
            arg.update(value=rule.check.value, valueTwo=0)
            entry["args"] = [arg]
        syscalls.append(entry)
    allowed = [s for s in syscalls if s["action"] == "SCMP_ACT_ALLOW" and "args" not in s]
    others = [s for s in syscalls if s not in allowed]
    merged = [{"names": [n for s in allowed for n in s["names"]], "action": "SCMP_ACT_ALLOW"}]
    profile = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": DEFAULT_ERRNO,
        "syscalls": merged + others,
    }
    return json.dumps(profile, separators=(",", ":"))


@functools.cache
def bpf_program() -> bytes:
    """The policy compiled for this machine's architecture, as bwrap's `--seccomp FD` reads it.

    Calls of another ABI (32-bit x86 on x86-64, say) are refused whole: no rule covers them.
    """
    import pyseccomp

    ops = {"eq": pyseccomp.EQ, "ne": pyseccomp.NE, "masked_eq": pyseccomp.MASKED_EQ}
    policy = pyseccomp.SyscallFilter(pyseccomp.ERRNO(DEFAULT_ERRNO))
    policy.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.ERRNO(errno.ENOSYS))
    native = pyseccomp.system_arch()
    for rule in RULES:
        if pyseccomp.resolve_syscall(native, rule.name) < 0:
            continue  # not a call of this architecture (e.g. the 32-bit names on x86-64)
        action = pyseccomp.ALLOW if rule.errno is None else pyseccomp.ERRNO(rule.errno)
        args = []
        if rule.check is not None:
            args.append(pyseccomp.Arg(rule.check.index, ops[rule.check.op], rule.check.value, 0))
        policy.add_rule(action, rule.name, *args)
    with tempfile.TemporaryFile() as out:
        policy.export_bpf(out)
        out.seek(0)
        return out.read()
