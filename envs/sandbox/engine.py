"""The container engine under the container sandbox backend: which one this host offers
(podman, else docker with a reachable local daemon), its command line, the default image
and the `run` options that put a sandbox's limits and isolation on a container.

Images are never pulled (these machines reach no registry). The default image is built
here from the host itself: a small skeleton (top-level links, mount points and the /etc
entries the system python needs) imported once into the engine's storage under a tag
that hashes its content, with the host's /usr bound read-only at run time, so a sandbox
on it sees the same runtime as a local sandbox. A task's own image (SandboxSpec.image)
must already be in local storage and gets nothing from the host but the workspace.

Nested user namespaces are blocked by a seccomp profile of our own (`seccomp_profile`):
the engines' default profiles let an unprivileged process create a user namespace, in
which it holds every capability (mounts, further namespaces), as bwrap's
--disable-userns forbids in the local backend. The same profile fails the kernel channels
between sandboxes that `envs.sandbox.seccomp` lists (the one list the local backend's
filter is built from too): podman's default allows keyctl, and a container's processes
share their host uid's keyrings with every later container of that uid.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
from dataclasses import dataclass

from envs.owner import owner_tag
from envs.sandbox import bwrap, seccomp
from envs.sandbox.base import WORKSPACE_MOUNT, SandboxLimits

log = logging.getLogger(__name__)

INSTALL_HINT = ("install podman (Debian: apt-get install -y podman runc) or give this "
                "host a reachable local docker daemon")
DEFAULT_IMAGE_REPO = "localhost/sluice-sandbox-host"
INIT_PATH = "/.sluice-init"  # where the init binary appears inside every container
_INIT_CANDIDATES = ("/usr/bin/catatonit", "/usr/libexec/podman/catatonit")
_IMAGE_LOCK = "/run/sluice-sandbox-image.lock"  # one import at a time on a host
# Settings of the engine itself; nothing else of this process's environment reaches it.
# containers-common's default profile: the base of ours, so every other rule still applies.
SECCOMP_DEFAULT_PATHS = ("/usr/share/containers/seccomp.json", "/etc/containers/seccomp.json")
CLONE_NEWUSER = 0x10000000
_EPERM, _ENOSYS = 1, 38
# Without a default profile to start from: allow all but seccomp.DENIED_SYSCALLS and these
# (they need capabilities the containers never have; denied for a second line).
_FALLBACK_DENIED = ("setns", "mount", "umount2", "pivot_root", "chroot")
_ENGINE_ENV_KEYS = ("DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "CONTAINER_HOST",
                    "CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF", "CONTAINERS_REGISTRIES_CONF")


@dataclass(frozen=True, slots=True)
class ContainerEngine:
    """A working engine CLI on this host."""

    name: str  # "podman" or "docker"
    path: str
    init_binary: str  # a static init (catatonit) bound into every container as pid 1

    def command(self, *args: str) -> list[str]:
        # podman as root needs runc here: its default (crun) fails on this kernel setup.
        runtime = ("--runtime", "runc") if self.name == "podman" else ()
        return [self.path, *runtime, *args]


def engine_env() -> dict[str, str]:
    env = dict(bwrap.LAUNCHER_ENV)
    env["HOME"] = os.path.expanduser("~")
    env.update({k: os.environ[k] for k in _ENGINE_ENV_KEYS if k in os.environ})
    return env


def run_engine(engine: ContainerEngine, *args: str, stdin: bytes | None = None,
               timeout_s: float = 120.0) -> str:
    """Run one engine command to completion; its stdout, or OSError with its stderr."""
    try:
        done = subprocess.run(engine.command(*args), input=stdin, capture_output=True,
                              env=engine_env(), timeout=timeout_s, check=False,
                              cwd=_engine_cwd())
    except subprocess.TimeoutExpired:
        raise OSError(f"`{engine.name} {' '.join(args[:2])}` took over {timeout_s:.0f}s") from None
    if done.returncode != 0:
        raise OSError(f"`{engine.name} {' '.join(args[:2])}` failed ({done.returncode}): "
                      f"{done.stderr.decode(errors='replace').strip()[-800:]}")
    return done.stdout.decode(errors="replace")


@functools.cache
def _engine_cwd() -> str:
    """A private working folder for engine commands: conmon writes files such as `oom`
    into its working directory, which must not be the caller's (e.g. a repository)."""
    # The owner tag lets envs.reaper delete the folder of a worker killed before atexit.
    path = tempfile.mkdtemp(prefix=f"sluice-container-engine-{owner_tag()}-")
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def _detect() -> ContainerEngine | str:
    """The engine, or why there is none (cached: probed once per process)."""
    init = next((p for p in _INIT_CANDIDATES if os.access(p, os.X_OK)), None)
    problems = []
    podman = shutil.which("podman", path=bwrap.LAUNCHER_ENV["PATH"])
    if podman is None:
        problems.append("podman is not installed")
    elif shutil.which("runc", path=bwrap.LAUNCHER_ENV["PATH"]) is None:
        problems.append("podman is installed but runc is not")
    else:
        engine = ContainerEngine("podman", podman, init or "")
        try:
            run_engine(engine, "info", "--format", "{{.Host.CgroupsVersion}}", timeout_s=30)
            if init is not None:
                return engine
            problems.append("podman works but its init (catatonit) is missing")
        except OSError as e:
            problems.append(f"podman does not work: {e}")
    docker = shutil.which("docker", path=bwrap.LAUNCHER_ENV["PATH"])
    if docker is None:
        problems.append("docker is not installed")
    else:
        engine = ContainerEngine("docker", docker, init or "")
        try:
            run_engine(engine, "version", "--format", "{{.Server.Version}}", timeout_s=10)
            if init is not None:
                return engine
            problems.append("docker works but no static init (catatonit) is on the host")
        except OSError as e:
            problems.append(f"docker has no reachable daemon: {e}")
    return "; ".join(problems)


def detect_engine() -> ContainerEngine:
    """The engine to use; ValueError naming what to install when none works."""
    found = _detect()
    if isinstance(found, ContainerEngine):
        return found
    raise ValueError(f"the container sandbox backend found no working container engine "
                     f"({found}); {INSTALL_HINT}, or set envs.sandbox_backend=local")


def image_exists(engine: ContainerEngine, image: str) -> bool:
    verb = ("image", "exists", image) if engine.name == "podman" else ("image", "inspect", image)
    try:
        run_engine(engine, *verb, timeout_s=60)
        return True
    except OSError:
        return False


def _skeleton_tar() -> bytes:
    """The default image's content: mount points, the host's top-level links into /usr,
    and the /etc entries the local backend shows (copied, small)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, 0
            tar.addfile(info)

        for name in ("usr", "etc", "proc", "dev", "sys", "run", "var", WORKSPACE_MOUNT[1:]):
            add_dir(name)
        add_dir("tmp", 0o1777)
        for name in bwrap.TOP_LEVEL_LINKS:
            path = f"/{name}"
            if os.path.islink(path):
                info = tarfile.TarInfo(name)
                info.type, info.linkname, info.mtime = tarfile.SYMTYPE, os.readlink(path), 0
                tar.addfile(info)
            elif os.path.isdir(path):
                add_dir(name)  # bound from the host at run time
        for name in ("passwd", "group", "hosts"):  # replaced per sandbox at run time
            info = tarfile.TarInfo(f"etc/{name}")
            info.mtime, info.mode = 0, 0o644
            tar.addfile(info, io.BytesIO(b""))
        for name in bwrap.ETC_ALLOWED:
            path = f"/etc/{name}"
            if not os.path.lexists(path):
                continue
            for parent in _parents(f"etc/{name}"):
                if parent not in tar.getnames():
                    add_dir(parent)

            def reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
                return info

            tar.add(path, arcname=f"etc/{name}", recursive=True, filter=reset)
    return buf.getvalue()


def _parents(arcname: str) -> list[str]:
    parts = arcname.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(2, len(parts) + 1)]


_image_lock = threading.Lock()
_default_images: dict[str, str] = {}


def ensure_default_image(engine: ContainerEngine) -> str:
    """The default image's tag, imported into the engine's storage if it is not there."""
    with _image_lock:
        if engine.path in _default_images:
            return _default_images[engine.path]
        content = _skeleton_tar()
        tag = f"{DEFAULT_IMAGE_REPO}:{hashlib.sha256(content).hexdigest()[:16]}"
        with open(_IMAGE_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be importing it now
            if not image_exists(engine, tag):
                log.info("importing the default sandbox image %s into %s", tag, engine.name)
                run_engine(engine, "import", "-", tag, stdin=content)
        _default_images[engine.path] = tag
        return tag


def host_runtime_mounts(etc_dir: str) -> list[str]:
    """`run` options of the default image: the host's /usr (and real top-level lib
    folders) read-only, and the sandbox's own passwd, group and hosts."""
    args = ["-v", "/usr:/usr:ro"]
    for name in bwrap.TOP_LEVEL_LINKS:
        path = f"/{name}"
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["-v", f"{path}:{path}:ro"]
    for name in ("passwd", "group", "hosts"):
        args += ["-v", f"{os.path.join(etc_dir, name)}:/etc/{name}:ro"]
    return args + ["--env", f"PATH={bwrap.SANDBOX_PATH}"]


# A task image's PATH (--unsetenv-all drops the image's own environment).
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _without_userns_rules(names: tuple[str, ...]) -> list[dict]:
    """Rules letting clone/unshare through only without CLONE_NEWUSER (flags are their
    first argument on x86_64 and arm64), and failing clone3 with ENOSYS: its flags sit in
    memory seccomp cannot read, and libc falls back to clone on ENOSYS."""
    def flags(datum: int) -> list[dict]:
        return [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": datum,
                 "op": "SCMP_CMP_MASKED_EQ"}]

    return [{"names": list(names), "action": "SCMP_ACT_ALLOW", "args": flags(0)},
            {"names": list(names), "action": "SCMP_ACT_ERRNO", "errnoRet": _EPERM,
             "args": flags(CLONE_NEWUSER)},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS}]


def build_seccomp_profile(default: dict | None) -> dict:
    """The engine's default profile (a parsed seccomp.json) with nested user namespaces
    blocked and seccomp.DENIED_SYSCALLS failed; None: a permissive profile denying those,
    `_FALLBACK_DENIED` and user namespaces. The calls ruled on here are taken out of every
    rule of the default first: a second rule for one call would conflict with ours."""
    userns_calls = ("clone", "unshare")
    denied = [*seccomp.profile_rules(), *_without_userns_rules(userns_calls)]
    if default is None:
        return {"defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": list(_FALLBACK_DENIED), "action": "SCMP_ACT_ERRNO",
                              "errnoRet": _EPERM}, *denied]}
    ours = {name for rule in denied for name in rule["names"]}
    profile = dict(default)
    rules = []
    for rule in default.get("syscalls", []):
        names = [n for n in rule.get("names", []) if n not in ours]
        if names:
            rules.append({**rule, "names": names})
    profile["syscalls"] = rules + denied
    return profile


@functools.cache
def seccomp_profile() -> str:
    """Path of the profile file every sandbox container gets (written once per process)."""
    default = None
    for path in SECCOMP_DEFAULT_PATHS:
        if os.path.isfile(path):
            with open(path) as f:
                default = json.load(f)
            break
    else:
        log.warning("no default seccomp profile in %s; containers get a permissive one that "
                    "blocks user namespaces, %s and %s", SECCOMP_DEFAULT_PATHS,
                    seccomp.denied_names(), _FALLBACK_DENIED)
    path = os.path.join(_engine_cwd(), "seccomp.json")
    with open(path, "w") as f:
        json.dump(build_seccomp_profile(default), f)
    os.chmod(path, 0o644)
    return path


def build_run_options(engine: ContainerEngine, *, name: str, limits: SandboxLimits,
                      workspace: str, tmp_size_mb: int,
                      workdir: str = WORKSPACE_MOUNT) -> list[str]:
    """`run` options every sandbox container gets (the image and its mounts follow).
    Its pid 1 is a root init that only reaps orphans: the sandbox's uid cannot signal
    it, so no command can stop the container, and every command joins it by `exec` as
    that uid with these limits (a container's rlimits apply to its exec'd processes).
    The workspace is bound at `workdir` (an image's repository path, e.g. /testbed)."""
    # RLIMIT_NPROC counts the sandbox uid's processes (the init is root's); the pids
    # cgroup counts every task of the container, the init too.
    nproc, tasks = limits.max_processes, limits.max_processes + 1
    options = [
        "run", "-d", "--name", name, "--label", "sluice.sandbox=1",
        "--network", "none", "--read-only", "--hostname", "sandbox",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--security-opt", f"seccomp={seccomp_profile()}",
        "--memory", f"{limits.memory_mb}m", "--memory-swap", f"{limits.memory_mb}m",
        "--pids-limit", str(tasks), "--cpus", f"{limits.cpu_quota_cores:g}",
        "--ulimit", f"nofile={limits.open_files}:{limits.open_files}",
        "--ulimit", f"nproc={nproc}:{nproc}",
        "--ulimit", f"cpu={limits.cpu_time_s}:{limits.cpu_time_s + 1}",
        "--ulimit", f"fsize={limits.file_size_mb << 20}:{limits.file_size_mb << 20}",
        "--ulimit", "core=0:0",
        "--tmpfs", f"/tmp:rw,nosuid,nodev,size={tmp_size_mb}m,mode=1777",
        "-v", f"{workspace}:{workdir}:rw", "-w", workdir,
        "--env", f"HOME={workdir}", "--env", "LANG=C.UTF-8",
        "--user", "0:0", "-v", f"{engine.init_binary}:{INIT_PATH}:ro",
        "--entrypoint", INIT_PATH,
    ]
    if engine.name == "podman":
        # --replace: a container of this name left by a crashed worker (same leased uid)
        # is removed in the same call. --unsetenv-all: no engine defaults (TERM, container).
        options += ["--pull=never", "--replace", "--read-only-tmpfs=false", "--no-hosts",
                    "--passwd=false", "--unsetenv-all", "--cgroupns", "private",
                    # Its own limits are not the sandbox's business (as in local).
                    "--security-opt", "mask=/sys/fs/cgroup"]
    else:
        options += ["--pull", "never", "--cgroupns", "private"]
    return options
