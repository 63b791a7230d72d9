"""The sandbox's checks on an aarch64 kernel, the CPU of a DGX Spark, from any Linux machine: `make aarch64-check`.

Only an aarch64 kernel enforces an aarch64 seccomp filter (QEMU's user mode refuses a guest's PR_SET_SECCOMP), and a
whole VM needs no disk image: Debian's arm64 packages (mmdebstrap) make a root, the root is the initramfs, and Debian's
arm64 kernel boots it under qemu-system-aarch64 in seconds. There, as root (so the children change user too), pytest
runs CHECKS: the kernel walls, every honest answer of the tests, the players' games and a reward batch exactly as
recorded on x86_64, with the tests' own game limits scaled for emulation (TRAIN2048_TEST_TIME_SCALE, never the
product's). Then the kernel's log names the system call of every child it killed. On an aarch64 machine the same
checks run natively, without QEMU (without root, the change of user is not checked, and the report says so).

    .venv/bin/python bench/aarch64_check.py                 # the root is built once and kept in .aarch64/
    .venv/bin/python bench/aarch64_check.py -- -k fork      # pytest's options after --, to narrow the checks
    .venv/bin/python bench/aarch64_check.py --full          # also the widest honest tour (WIDEST)

Exit status: 0 when every check ran and passed; 1 when one failed or was skipped (but for that), or the VM did not
report in time; 2 when a tool is missing (apt-get install -y qemu-system-arm mmdebstrap cpio). docs/PERF.md has its
time, docs/SECURITY.md what it proves.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".aarch64"  # the root and kernel, built once (git-ignored)
SUITE = "bookworm"  # Debian 12: Python 3.11 and glibc 2.36, as the project's CPU set here; Linux 6.1
PACKAGES = ("python3", "libseccomp2", "libc-bin", "busybox-static", "linux-image-cloud-arm64", "python3-pytest",
            "python3-psutil")  # fmt: skip
PRUNED = ("boot", "lib/modules", "usr/share/doc", "usr/share/locale", "usr/share/man")  # the kernel needs no modules
CHECKS = [
    "tests/test_sandbox_attacks.py::" + name
    for name in (
        "test_every_step_outside_the_process_is_seen_by_the_kernel",
        "test_each_step_outside_scores_exactly_like_the_forbidden_import",
        "test_what_a_running_process_needs_stays_allowed",
        "test_the_call_numbers_are_the_kernels",
        "test_the_filters_argument_values_are_this_machines",
        "test_a_fatal_error_is_a_crash",
        "test_ctypes_segfault_is_a_crash",
        "test_memory_limit_alone",
        "test_children_of_a_root_trainer_run_as_an_unprivileged_user_of_their_own",
        "test_another_user_alone_keeps_the_trainer_and_its_files_out_of_reach",
    )
] + ["tests/test_detection.py", "tests/test_architectures.py"]
# The widest honest corpus, every public callable of the allowed modules with wrong arguments: ~3 min in the VM, so
# only with --full (it passed there: docs/PERF.md).
WIDEST = "tests/test_detection.py::test_every_public_callable_with_wrong_arguments_fails_as_in_plain_python"
TIME_SCALE = 15.0  # QEMU's aarch64 emulation here runs Python ~8-15x slower than the host (docs/PERF.md)
# Pointer authentication by QEMU's own cheap hash instead of the architected QARMA5: the same instructions, a third of
# the boot time (QEMU documents pauth-impdef for speed).
QEMU = ["qemu-system-aarch64", "-M", "virt", "-cpu", "max,pauth-impdef=on", "-m", "3G", "-nographic", "-no-reboot"]
# The kernel logs seccomp's kills only with auditing on; no audit daemon reads them, so they wait in a queue that must
# hold them all (and the kernel prints each to its log, which is what KernelLog reads).
AUDIT = "audit=1 audit_backlog_limit=65536"
MARK = "@@aarch64-check "  # the line that carries the result out of the VM
INIT = """#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox mount -t tmpfs tmp /tmp
/bin/busybox mkdir -p /dev/mqueue
/bin/busybox mount -t mqueue mqueue /dev/mqueue
/bin/busybox ip link set lo up
echo 0 > /proc/sys/kernel/printk_ratelimit
/sbin/ldconfig
export PATH=/usr/bin:/bin:/usr/sbin:/sbin HOME=/root
cd /project
python3 bench/aarch64_check.py --inside {args}
/bin/busybox poweroff -f
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="after --: options for pytest")
    parser.add_argument("--time_scale", type=float, help=f"scale tests' game limits ({TIME_SCALE:g} in a VM, else 1)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the VM may take before it is a failure")
    parser.add_argument("--full", action="store_true", help="also the widest honest tour (~3 min more in the VM)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # in the VM, or natively
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not args.full and not args.inside:
        extra = ["--deselect", WIDEST, *extra]
    if args.inside:
        return run_checks(args.time_scale or 1.0, extra)
    if platform.machine() == "aarch64":
        start = time.monotonic()
        print("aarch64 check: natively on this aarch64 machine, no VM", flush=True)
        return report(run_natively(args.time_scale or 1.0, extra), start)
    return in_vm(args.time_scale or TIME_SCALE, args.timeout, extra)


# --- where the checks run: inside the VM, or natively on aarch64 ---------------------------------------------------


def run_checks(time_scale: float, extra: list[str]) -> int:
    """Run CHECKS with pytest, then print one MARK line: the counts, the failures and what the kernel killed."""
    start = time.monotonic()
    kernel_log = KernelLog()
    env = dict(os.environ, TRAIN2048_TEST_TIME_SCALE=str(time_scale))
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--durations=15", f"--junitxml={junit}",
               *CHECKS, *extra]  # fmt: skip
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        counts = junit_counts(junit)
    result = dict(
        rc=rc, seconds=round(time.monotonic() - start, 1), time_scale=time_scale, **counts,
        machine=platform.machine(), kernel=platform.release(), python=platform.python_version(),
        root=os.geteuid() == 0, kills=kernel_log.seccomp_kills(),
    )  # fmt: skip
    print(MARK + json.dumps(result), flush=True)
    return 0 if passed(result) else 1


def run_natively(time_scale: float, extra: list[str]) -> dict | None:
    cmd = [sys.executable, __file__, "--inside", "--time_scale", str(time_scale), "--", *extra]
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True) as checks:
        return relay(checks.stdout)


def junit_counts(path: Path) -> dict:
    """Tests run, failed and skipped, from pytest's JUnit XML (absent when pytest could not start)."""
    counts = dict(tests=0, failed=[], skipped=[])
    if not path.exists():
        return counts
    for case in ET.parse(path).getroot().iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '').rpartition('.')[2]}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"].append([name, case.find("skipped").get("message", "")])
    return counts


class KernelLog:
    """The kernel's log from now on: each child seccomp killed is an audit record (type 1326) with its call's number."""

    def __init__(self):
        try:
            self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:  # not root (a DGX Spark user): the kills go unnamed
            self.fd = None

    def seccomp_kills(self) -> dict | None:
        """{call name: children killed for it}, or None where the log cannot be read."""
        if self.fd is None:
            return None
        numbers = []
        while True:
            try:
                record = os.read(self.fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # a record overwritten while we read: go on
                continue
            found = re.search(r"type=1326 .* syscall=(\d+) .*code=0x(0|80000000)\b", record)
            if found:
                numbers.append(int(found.group(1)))
        os.close(self.fd)
        try:
            import pyseccomp

            def name(n: int) -> str:
                try:
                    return pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n).decode()
                except ValueError:  # a number in no table (a step calls one)
                    return f"number {n:#x}"
        except ImportError:
            name = str
        kills: dict[str, int] = {}
        for n in numbers:
            kills[name(n)] = kills.get(name(n), 0) + 1
        return dict(sorted(kills.items()))


# --- the VM ----------------------------------------------------------------------------------------------------------


def in_vm(time_scale: float, timeout: float, extra: list[str]) -> int:
    start = time.monotonic()
    missing = [tool for tool in ("qemu-system-aarch64", "mmdebstrap", "cpio") if shutil.which(tool) is None]
    if missing:
        print(f"aarch64 check: needs {', '.join(missing)} (Debian: apt-get install -y qemu-system-arm mmdebstrap cpio)")
        return 2
    pyseccomp = importlib.util.find_spec("pyseccomp")
    if pyseccomp is None or not pyseccomp.origin:
        print("aarch64 check: needs pyseccomp in this Python (run it with .venv/bin/python: make aarch64-check)")
        return 2
    kernel, base = base_root()
    initrd = CACHE / "initrd.cpio"
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        overlay = Path(tmp) / "root"
        project_files(overlay / "project")
        packages = overlay / "usr/lib/python3/dist-packages"  # pure Python: libseccomp through ctypes
        packages.mkdir(parents=True)
        shutil.copy(pyseccomp.origin, packages / "pyseccomp.py")
        pytest_args = " ".join(shell_quote(a) for a in ["--time_scale", str(time_scale), "--", *extra])
        (overlay / "init").write_text(INIT.format(args=pytest_args))
        byte_compile(overlay, ["project"])
        (overlay / "init").chmod(0o755)
        with initrd.open("wb") as out:
            with base.open("rb") as f:
                shutil.copyfileobj(f, out)
            out.flush()
            files = subprocess.run(["find", ".", "-mindepth", "1"], cwd=overlay, stdout=subprocess.PIPE, check=True)
            subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=overlay, input=files.stdout, stdout=out,
                           check=True)  # fmt: skip
    cpus = str(max(1, min(4, os.cpu_count() or 1)))
    cmd = QEMU + ["-smp", cpus, "-kernel", str(kernel), "-initrd", str(initrd),
                  "-append", f"console=ttyAMA0 rdinit=/init quiet {AUDIT}"]  # fmt: skip
    print(f"aarch64 check: booting Debian {SUITE} arm64 under {' '.join(cmd[:5])} (time scale {time_scale:g})",
          flush=True)  # fmt: skip
    vm = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        result = relay(lines_until(vm, start + timeout))
    finally:
        if vm.poll() is None:
            vm.kill()
        vm.wait()
        initrd.unlink(missing_ok=True)
    return report(result, start)


def base_root() -> tuple[Path, Path]:
    """Debian's arm64 kernel and the root as an uncompressed cpio archive (the kernel copies it, nothing to inflate),
    built once per package list and kept in .aarch64/."""
    recipe = repr((SUITE, PACKAGES, PRUNED, sys.version_info[:2])) + inspect.getsource(base_root)
    key = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    kernel, archive = CACHE / f"vmlinuz-{key}", CACHE / f"root-{key}.cpio"
    if kernel.exists() and archive.exists():
        return kernel, archive
    CACHE.mkdir(exist_ok=True)
    for old in [*CACHE.glob("vmlinuz-*"), *CACHE.glob("root-*.cpio")]:  # another recipe's
        old.unlink()
    print(f"aarch64 check: building the arm64 root in {CACHE} (once)", flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp) / "root"
        subprocess.run(["mmdebstrap", "--quiet", "--variant=extract", "--architectures=arm64",
                        "--include=" + ",".join(PACKAGES), SUITE, str(root)], check=True)  # fmt: skip
        shutil.copy(next((root / "boot").glob("vmlinuz-*")), Path(tmp) / "vmlinuz")
        for path in PRUNED:
            shutil.rmtree(root / path)
        for path in ("proc", "sys", "tmp", "project"):
            (root / path).mkdir(exist_ok=True)
        (root / "bin/sh").symlink_to("busybox")  # subprocess's shell; the image has no other
        byte_compile(root, ["usr/lib/python3", f"usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}"])
        files = subprocess.run(["find", ".", "-mindepth", "1"], cwd=root, stdout=subprocess.PIPE, check=True)
        with open(Path(tmp) / "root.cpio", "wb") as out:
            subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files.stdout, stdout=out,
                           check=True)  # fmt: skip
        os.replace(Path(tmp) / "vmlinuz", kernel)
        os.replace(Path(tmp) / "root.cpio", archive)
    print(f"aarch64 check: root built in {time.monotonic() - start:.0f} s ({archive.stat().st_size >> 20} MiB)")
    return kernel, archive


def project_files(dest: Path) -> None:
    """The working tree as git sees it (tracked, and new files not ignored), what the checks test."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            stdout=subprocess.PIPE, check=True).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a file deleted in the working tree is still listed
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def byte_compile(root: Path, folders: list[str]) -> None:
    """Compile the root's Python files here, where it is quick: the package manager that would have was not run, and
    under emulation every Python process would compile what it imports. Bytecode is the same on every CPU; only a
    Python of the root's version (here, as on Debian 12, 3.11) writes files the root's Python reads."""
    folders = [str(root / f) for f in folders if (root / f).is_dir()]
    if folders:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "checked-hash",
                        "-s", str(root), "-p", "/", *folders], stdout=subprocess.DEVNULL)  # fmt: skip


def shell_quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


def lines_until(vm: subprocess.Popen, deadline: float):
    """The VM's console, line by line, until it powers off or the deadline passes."""
    buffer = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            print("\naarch64 check: the VM did not finish in time; stopped", flush=True)
            return
        ready, _, _ = select.select([vm.stdout], [], [], min(left, 5.0))
        if not ready:
            continue
        chunk = os.read(vm.stdout.fileno(), 65536)
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode(errors="replace").rstrip("\r") + "\n"
    if buffer:
        yield buffer.decode(errors="replace")


def relay(lines) -> dict | None:
    """Echo the checks' output; return what the MARK line carried, or None if no line did."""
    result = None
    for line in lines:
        if MARK in line:  # a kernel message may have been printed in front of it
            result = json.loads(line[line.index(MARK) + len(MARK) :])
        else:
            sys.stdout.write(line)
            sys.stdout.flush()
    return result


# --- the verdict -----------------------------------------------------------------------------------------------------


# What a run without root cannot check (natively, as a DGX Spark's user): said, and there not a failure. The reason
# tests/test_sandbox_attacks.py's root_only gives.
NOT_ROOT = "children change user only when the trainer is root"


def passed(result: dict | None) -> bool:
    """Every check ran and passed: pytest's status 0, tests run, none failed, none skipped (but the change of user's
    where we are not root)."""
    if not result or result["rc"] != 0 or result["tests"] == 0 or result["failed"]:
        return False
    return all(not result["root"] and reason == NOT_ROOT for _, reason in result["skipped"])


def report(result: dict | None, start: float) -> int:
    took = time.monotonic() - start
    if result is None:
        print(f"aarch64 check FAILED: no result came back ({took:.0f} s)")
        return 1
    failed, skipped = result["failed"], result["skipped"]
    ran = result["tests"] - len(failed) - len(skipped)
    print(
        f"\naarch64 check on {result['machine']} (Linux {result['kernel']}, Python {result['python']}, "
        f"{'root' if result['root'] else 'not root'}, time scale {result['time_scale']:g}): {ran} passed, "
        f"{len(failed)} failed, {len(skipped)} skipped; tests {result['seconds']:.0f} s, all {took:.0f} s"
    )
    kills = result["kills"]
    if kills is None:
        print("  children the kernel killed: its log is not readable here")
    else:
        print(f"  children the kernel killed, by system call: {sum(kills.values())} ("
              + ", ".join(f"{name} {count}" for name, count in kills.items()) + ")")  # fmt: skip
    for name in failed:
        print(f"  failed: {name}")
    reasons: dict[str, list[str]] = {}
    for name, reason in skipped:
        reasons.setdefault(reason, []).append(name)
    for reason, names in reasons.items():  # a check that did not run is not a pass
        what = "not checked without root" if reason == NOT_ROOT and not result["root"] else "skipped"
        print(f"  {what}: {len(names)} ({reason}): " + ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    print("aarch64 check " + ("passed" if passed(result) else "FAILED"))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:  # mmdebstrap or cpio said why above
        sys.exit(f"aarch64 check: {' '.join(map(str, exc.cmd[:2]))} failed with status {exc.returncode}")
