"""Connecting to Ray: which cluster a launch joins, and the private one it otherwise starts.

Ray's own rule for `ray.init()` without an address, kept here: join the cluster named by
--ray-address or RAY_ADDRESS, else the one `ray start` last recorded on this machine, else start a
private one. Never `address="auto"`, which joins whatever Ray processes a scan of this host finds,
another program's private cluster included (its prompts would go there, and its shutdown would
kill this launch's workers).

Ray 2.60's servers listen on every interface, and a private cluster advertises the host's own
address (the README's Security section lists the ports). A session this module opened (a private
cluster it started, or a running cluster it joined) is closed when the last launch of the process
using it shuts down: a private cluster is stopped, a joined one only disconnected from. A cluster
the user runs is left running, and a Ray session the calling program opened itself stays open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from launcher.errors import LaunchError, RayStartFailed, error_chain

_OWN_SESSION = {"users": 0, "started_here": False, "address": "", "dead_at_start": frozenset()}
"""The Ray session this module opened in this process, and how many of its connections are open:
the last one to close ends it, so one launch's shutdown no longer disconnected another launch of
the same process from its workers. dead_at_start: the private Ray's processes already exited when
it had started (see dead_when_started)."""
_SESSION_LOCK = threading.Lock()
_CONNECT_LOCK = threading.RLock()
"""Held by connect() from its look at ray.is_initialized() until the session is recorded, and by a
close from its count of the users to ray.shutdown(). Two launches connecting from two threads at
once both saw no session; the second ray.init failed (a bare AssertionError) and its clean-up's
ray.shutdown() stopped the first launch's private Ray under it, which Ray's auto-init later
replaced with a new one. Reentrant: a close on the thread that connects (a signal's clean-up)
does not wait for itself."""
_TEARDOWN_LEFT_TO_EXIT = threading.Event()
"""Set by RayConnection.close_for_exit: the process must end with os._exit, not run Ray's exit hook."""


@dataclass
class RayConnection:
    started_here: bool
    """True when corelaunch started this Ray instance (and so must shut it down)."""
    address: str
    joined_here: bool = False
    """True when corelaunch joined a running cluster itself (ray.init with its address): the last
    connection to close disconnects this process and leaves the cluster running. A later launch in
    the same process then connects where it is told: the session left open took any later
    ray_address, "local" included, to the first launch's cluster."""
    closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        import ray

        if not (self.started_here or self.joined_here):
            return  # the calling program's own session
        with _CONNECT_LOCK:  # a connect() meanwhile would share the session this shuts down
            with _SESSION_LOCK:
                if self.closed:
                    return
                self.closed = True
                _OWN_SESSION["users"] -= 1
                if _OWN_SESSION["users"] > 0:
                    return  # another launch of this process still uses it
            if ray.is_initialized():
                # Ray's calls start a new local Ray when none is connected (its auto-init): a thread of
                # this launcher still waiting on its ranks (a late restart) would start one behind its
                # back, between any check of ray.is_initialized() and its call. Off until the next
                # connect(), which says explicitly what to join.
                _auto_init(False)
                ray.shutdown()
            _release_keepers()

    def close_for_exit(self) -> bool:
        """close() for a program that ends right after (`corelaunch serve`). A private cluster this
        process alone uses has its processes stopped while this process is still whole, and Ray's
        teardown of the process itself is left out: True then, and the program must end with
        os._exit (teardown_left_to_exit() says so; Ray's exit hook would run it). Else close(), False.

        Run before the processes stopped, that teardown raced with their last calls to this process:
        one answered after the driver's core worker was gone made Ray end the process on the spot with
        status 1 ("The core worker has already been shutdown"), whatever the command's own code (a
        server stopped cleanly by SIGTERM failed CI so). Run after, it waits 5 s on a flush to the
        stopped GCS."""
        import ray
        from ray._private import worker as ray_worker

        with _CONNECT_LOCK:  # as close(): no connect() may share what is being stopped
            node = ray_worker._global_node
            with _SESSION_LOCK:
                alone = (self.started_here and not self.closed and _OWN_SESSION["users"] == 1 and node is not None
                         and ray.is_initialized())
                if alone:
                    self.closed = True
                    _OWN_SESSION["users"] = 0
            if not alone:
                self.close()
                return False
            _auto_init(False)  # as close(): no call left may start another Ray
            if node.is_head():
                node.destroy_external_storage()  # spilled objects, as ray.shutdown() removes them
            node.kill_all_processes(check_alive=False, allow_graceful=True)
            # Ray's exception hook sends an uncaught error to the GCS just stopped: it waited 60 s, then
            # ended the process without the traceback
            sys.excepthook = sys.__excepthook__
            _TEARDOWN_LEFT_TO_EXIT.set()
            _release_keepers()
            return True


def teardown_left_to_exit() -> bool:
    """Whether RayConnection.close_for_exit stopped this process's private cluster and left Ray's
    teardown of the process out: it must end with os._exit."""
    return _TEARDOWN_LEFT_TO_EXIT.is_set()


def _auto_init(enabled: bool) -> None:
    """Ray's implicit ray.init() on its first call without a connection (RAY_ENABLE_AUTO_CONNECT,
    read once at import; this is the flag its calls read each time), on or off."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = enabled and os.environ.get("RAY_ENABLE_AUTO_CONNECT", "") != "0"


def private_cluster(address: str | None) -> bool:
    """True when connect(address) starts a private cluster of this host alone, or shares the one an
    earlier launch of this process started and still runs on."""
    if asked_cluster(address)[0] is not None:
        return False
    import ray

    if ray.is_initialized():
        with _SESSION_LOCK:  # shared where it is the cluster asked for; connect() refuses another
            if _OWN_SESSION["users"] > 0:
                return bool(_OWN_SESSION["started_here"])
        return False  # the calling program's own session: connect() joins it, wherever it is
    return True


def private_cluster_cpus(num_cpus: int | None = None) -> int:
    """The CPUs the node of a private cluster that connect(num_cpus=...) starts declares: num_cpus,
    else those this process may use (its affinity and cgroup quota counted: shardlib/host_cpus.py;
    os.cpu_count() gave a rank in a 4-CPU container on a 64-core host 64 threads). The plan counts
    the same total before the start (launch_plan.refuse_what_a_private_start_cannot_hold): both
    refuse the same groups."""
    from shardlib.host_cpus import host_cpus

    return num_cpus or host_cpus()


def asked_cluster(address: str | None) -> tuple[str | None, str]:
    """(the cluster address connect(address) joins, None for a private cluster; where it came from),
    by Ray's rule: --ray-address, else RAY_ADDRESS, else the cluster `ray start` recorded here."""
    if address == "local":
        return None, "--ray-address local"
    if address is not None:
        return address, "--ray-address"
    if os.environ.get("RAY_ADDRESS") == "local":  # Ray's own reading too: a new local instance
        return None, "RAY_ADDRESS local"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if (recorded := recorded_cluster()) is not None:
        return recorded, "the cluster `ray start` recorded on this machine"
    return None, "no address given and no cluster recorded on this machine"


def _another_cluster_asked(address: str | None) -> str | None:
    """Why a launch asking for `address` cannot share the session an earlier launch of this process
    opened and still runs on (one Ray session per process), or None. The session was shared
    whatever the address: a launch given a cluster's host:port, or one nobody listened on, ran on
    the first launch's private cluster, and timed out placing its ranks there."""
    started, open_at = _OWN_SESSION["started_here"], _OWN_SESSION["address"]
    wanted, how = asked_cluster(address)
    if (wanted is None) == started and (started or _same_cluster(wanted, open_at)):
        return None
    here = "a private Ray cluster it started" if started else f"the Ray cluster at {open_at!r}"
    asked = "a private one" if wanted is None else repr(wanted)
    return (f"this process is already connected to {here} for another launch still running, and one process holds "
            f"one Ray session; this launch asks for {asked} ({how}): give it the same cluster as the running "
            f"launch, or shut that one down first (Launcher.shutdown())")


def _programs_session_elsewhere(address: str | None) -> str | None:
    """Why a launch given `address` outright cannot join the Ray session the calling program opened
    itself (its own ray.init), or None: the session was joined whatever the address asked, so a
    launch given another cluster's host:port ran on the program's cluster. Only a host:port given
    outright is compared: None and "local" take the program's session, RAY_ADDRESS is left alone
    (inside a Ray job or a Serve replica it names the cluster the session is on), and neither a
    ray:// address nor a Ray Client session names a GCS to compare with."""
    import ray

    if address in (None, "local") or address.startswith("ray://") or _ray_client_session():
        return None
    open_at = ray.get_runtime_context().gcs_address
    if not open_at or _same_cluster(address, open_at):
        return None
    return (f"this process is already connected to the Ray cluster at {open_at!r} (a Ray session the program "
            f"opened itself), and one process holds one Ray session; this launch asks for {address!r} "
            f"(--ray-address): give it that cluster's address or none, or end the program's session first "
            f"(ray.shutdown())")


def _ray_client_session() -> bool:
    """Whether this process's Ray session is Ray Client's (ray://), which knows no GCS address here."""
    try:
        from ray.util.client import ray as client_ray
    except ImportError:
        return False
    return bool(client_ray.is_connected())


def on_this_host(address: str | None) -> bool:
    """True when connect(address) reaches a cluster on this machine: a private local one (--ray-address
    or RAY_ADDRESS local), or one started here with `ray start --head` (no --ray-address and no
    RAY_ADDRESS)."""
    return address == "local" or (address is None and os.environ.get("RAY_ADDRESS", "") in ("", "local"))


def recorded_cluster() -> str | None:
    """The address `ray start` recorded on this machine (Ray's /tmp/ray/ray_current_cluster; `ray
    stop` removes it), or None."""
    from ray._private.utils import read_ray_address  # what ray.init() itself reads

    return read_ray_address() or None


GCS_PROBE_S = 10.0
"""How long a host:port address gets to accept a TCP connection before Ray is asked to join it."""


def malformed_address(address: str) -> str | None:
    """Why `address` is none of the forms connect() takes ("local", "host:port", "ray://host..."),
    or None. Ray's own answer to a malformed one is a logged traceback and "Malformed host"."""
    if address in ("local", "auto"):
        return None
    client = address.startswith("ray://")
    if "://" in address and not client:  # http://host:8265 passed the host:port test and Ray blamed RAY_ADDRESS
        return (f"ray_address ({address!r}) is a URL; corelaunch joins the head's GCS at host:port (e.g. "
                f"10.0.0.5:6379), or ray://host:port for Ray Client, or 'local' for a private cluster "
                f"(http://host:8265 is the dashboard's address, the one `ray job submit --address` takes)")
    host, port = _host_and_port(address[len("ray://"):] if client else address)
    if ":" in host and not host.startswith("["):
        # split at its last colon, 2001:db8::5 read as host 2001:db8: and port 5
        return (f"ray_address ({address!r}) has a host with colons outside brackets: write an IPv6 host in "
                f"brackets: [2001:db8::5]:6379 (ray://[2001:db8::5]:10001 for Ray Client)")
    if client:  # its port is Ray Client's to default and check; a missing host was blamed on "another machine ()"
        if host.strip("[]"):
            return None
        return (f"ray_address ({address!r}) names no host: Ray Client's address is ray://host:port (e.g. "
                f"ray://10.0.0.5:10001)")
    if host.strip("[]") and port.isascii() and port.isdigit() and 0 < int(port) < 65536:
        return None
    return (f"ray_address ({address!r}) must be the head's host:port (e.g. 10.0.0.5:6379), ray://host:port "
            f"for Ray Client, or 'local' for a private cluster")


def _host_and_port(text: str) -> tuple[str, str]:
    """(host, port) of "host:port", "[v6]:port" or a bare host (port ""); a bracketed host keeps its
    brackets, so that a colon in a host outside them shows."""
    if text.startswith("["):
        inside, closed, after = text.partition("]")
        if closed and (not after or after.startswith(":")):
            return inside + closed, after[1:]
        return "", ""  # an unclosed bracket, or text after it: no host read
    host, sep, port = text.rpartition(":")
    return (host, port) if sep else (text, "")


def remote_ray_client(address: str) -> str | None:
    """The host of a ray://host:port address when it is another machine (None for this one, or for
    another form). Ray Client runs the driver here and its workers there: rank 0 streams a group's
    tokens to a socket the driver opens on its own machine, which a cluster elsewhere cannot reach
    (every launch failed after its start-up timeout)."""
    if not address.startswith("ray://"):
        return None
    host = _host_and_port(address[len("ray://"):])[0].strip("[]")
    if not host:
        return None  # no host: malformed_address says so
    return None if _this_machine(host) else host  # unresolvable: ray.init says so; not this machine either way


def _this_machine(host: str) -> bool:
    """True when `host` resolves to an address of this machine's interfaces (loopback included)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)  # IPv4 and IPv6
    except OSError:
        return False
    for family, _, _, _, sockaddr in found:
        try:  # a family the host has turned off raises here too
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))  # only an address of this machine's interfaces binds
                return True
        except OSError:
            continue
    return False


def _same_cluster(asked: str, open_at: str) -> bool:
    """Whether two host:port addresses reach the same GCS: the same text, or the same port on the
    same machine however its host is written (localhost, 127.0.0.1, the host's own address or
    name: Ray's servers listen on every interface), or host names resolving alike."""
    if asked == open_at:
        return True
    (host_a, sep_a, port_a), (host_b, sep_b, port_b) = asked.rpartition(":"), open_at.rpartition(":")
    if not (sep_a and sep_b) or port_a != port_b or "://" in asked or "://" in open_at:
        return False
    host_a, host_b = host_a.strip("[]"), host_b.strip("[]")
    if _this_machine(host_a) and _this_machine(host_b):
        return True
    try:
        return ({a[4][0] for a in socket.getaddrinfo(host_a, None, type=socket.SOCK_STREAM)}
                == {a[4][0] for a in socket.getaddrinfo(host_b, None, type=socket.SOCK_STREAM)})
    except OSError:
        return False


def _unreachable(address: str, timeout_s: float = GCS_PROBE_S, sends_token: bool = True,
                 token: tuple[tuple[str, str], ...] = ()) -> str | None:
    """Why nothing accepts connections at a "host:port" address (None when something does, or for
    another form, such as ray://, which ray.init checks itself). sends_token: whether the launch
    will send Ray's token (TOKEN_NEEDED when it will not and the GCS asks for one); token: the
    metadata carrying it (_token_metadata), sent with the probe (WRONG_TOKEN when the GCS refuses it)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "://" in address or not port.isascii() or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except socket.gaierror as err:
        return f"its host name does not resolve: {err}"
    except ConnectionRefusedError as err:  # at once: "within 10 s" read as a slow network
        return f"nothing listens there: {err}"
    except OSError as err:
        return f"nothing accepts connections there within {timeout_s:g} s: {err}"
    return _not_a_gcs(address, timeout_s, sends_token, token)


TOKEN_NEEDED = "token needed"
"""_unreachable's answer for a GCS that refuses a launch sending no token."""
WRONG_TOKEN = "wrong token"
"""_unreachable's answer for a GCS that refuses the token the launch sends: ray.init retried for
some 20 s, printed 20 lines of Ray's warnings and was reported as "no Ray cluster answered"."""
TOKEN_SOURCES = "RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token"
"""Where Ray's token loader looks for the token, in its order."""
_GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
"""A call only a Ray GCS answers (its empty request is a valid message): a GCS answers it, one with
token authentication refuses it UNAUTHENTICATED, any other gRPC server UNIMPLEMENTED."""


def _not_a_gcs(address: str, timeout_s: float, sends_token: bool = True,
               token: tuple[tuple[str, str], ...] = ()) -> str | None:
    """Why the listener at `address` is not a Ray GCS, which speaks gRPC (None when it answers as
    one). ray.init retried anything else for ever, such as the dashboard's port, which `ray job
    submit --address` takes."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None  # a TLS GCS does not answer a plaintext channel: ray.init checks it itself
    import grpc  # Ray's own dependency

    # Not through an HTTP proxy the environment names: Ray's own channels never are (its
    # GLOBAL_GRPC_OPTIONS), and a proxy that cannot reach the head would fail a healthy GCS here.
    channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        try:
            channel.unary_unary(_GCS_METHOD)(b"", timeout=timeout_s, metadata=token)
        except grpc.RpcError as err:
            # Another gRPC server (Ray Client's port, 10001 by default) passed the handshake, and
            # ray.init failed some 25 s later saying no cluster answered; a GCS wanting a token this
            # launch does not send printed 20 lines of Ray's warnings first, with the same message.
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return ("something answers gRPC there but is not a Ray GCS (it does not know the GCS's calls): "
                        "Ray Client's port, 10001 by default, takes ray://host:port; the head's GCS port is "
                        "6379 by default (`ray start --head --port`)")
            if err.code() == grpc.StatusCode.UNAUTHENTICATED and token:
                return WRONG_TOKEN
            if err.code() == grpc.StatusCode.UNAUTHENTICATED and not sends_token:
                return TOKEN_NEEDED
        return None  # a GCS, or an answer that says nothing (ray.init decides)
    except grpc.FutureTimeoutError:
        return (f"something accepts connections there but does not answer as a Ray GCS (gRPC) within "
                f"{timeout_s:g} s: the head's GCS port is 6379 by default (`ray start --head --port`); "
                f"8265 is the dashboard's, for `ray job submit --address`")
    finally:
        channel.close()


def _token_mode() -> bool:
    """Whether this launch sends Ray's token: RAY_AUTH_MODE as connect() reads it now, not as Ray's
    config read it at import."""
    return os.environ.get("RAY_AUTH_MODE", "").lower() == "token"


def _token_metadata() -> tuple[tuple[str, str], ...]:
    """The gRPC metadata carrying the token ray.init would send (("authorization", "Bearer ..."),),
    by Ray's own token loader, or () where the launch sends none (RAY_AUTH_MODE is not "token", no
    token is found, or a Ray without the loader: ray.init then says what is wrong). Decided on
    RAY_AUTH_MODE as connect() reads it, not on the mode Ray's config read at import; the loader's
    cache is reset so that the probe and ray.init read the sources as they are now."""
    if not _token_mode():
        return ()
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:
        return ()
    loader = AuthenticationTokenLoader.instance()
    try:
        loader.reset_cache()
        return tuple(loader.get_token_for_http_header(ignore_auth_mode=True).items())
    except Exception as err:  # noqa: BLE001 - Ray's AuthenticationError: a token file it cannot read
        # said as "none was found", which named neither the file nor why, and ~/.ray/auth_token as a
        # fallback Ray does not take once RAY_AUTH_TOKEN_PATH is set
        said = str(err).strip().split(". ")[0] or "no reason given"  # Ray's advice after it names the wrong file
        raise LaunchError(f"RAY_AUTH_MODE=token, but Ray could not read its token ({type(err).__name__}: {said}): "
                          f"fix the file RAY_AUTH_TOKEN_PATH names, or set RAY_AUTH_TOKEN to the cluster's "
                          f"token (`ray get-auth-token` on its head prints it)") from None


def _token_source() -> str:
    """Which of TOKEN_SOURCES the token sent came from, by the loader's order."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"the file RAY_AUTH_TOKEN_PATH names ({os.environ['RAY_AUTH_TOKEN_PATH']})"
    return "~/.ray/auth_token"


def _token_refused(address: str, how: str) -> str:
    """The refusal of a launch whose token the cluster at `address` does not take."""
    return (f"the Ray cluster at {address!r} ({how}) refused this launch's token (from {_token_source()}; Ray reads "
            f"{TOKEN_SOURCES}): use the cluster's token (`ray get-auth-token` on its head prints it) in one of them")


def _token_missing(address: str, how: str) -> str:
    """The refusal of a launch that sends no token to a cluster that requires one."""
    if _token_mode():
        return (f"the Ray cluster at {address!r} ({how}) requires a token and none was found ({TOKEN_SOURCES}): "
                f"put the cluster's token (`ray get-auth-token` on its head prints it) in one of them")
    return (f"the Ray cluster at {address!r} ({how}) requires token authentication, which this launch does not "
            f"use: set RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN")


_AUTO_JOINS_ANY = "joins any Ray found running on this host, another user's private cluster included"


def connect(address: str | None = None, num_cpus: int | None = None, worker_logs: bool = False) -> RayConnection:
    """`address`: None (RAY_ADDRESS, else a cluster `ray start` recorded here, else a private
    local one), "local" (always a private one), or "host:port"; "auto" is refused.

    worker_logs: print the workers' output in this process (Ray's log_to_driver: their stderr on
    stderr, their stdout on stdout, each line prefixed with the actor and its pid; the rank actors
    write nothing on stdout, see ray_worker.py). Only for a connection made here: a Ray session the
    calling program opened keeps its own setting.

    Launches connecting from several threads at once connect one at a time (_CONNECT_LOCK): the
    later ones share the session the first opened, or are refused where they ask for another."""
    with _CONNECT_LOCK:
        return _connect(address, num_cpus, worker_logs)


def _connect(address: str | None, num_cpus: int | None, worker_logs: bool) -> RayConnection:
    import ray

    if address == "auto":
        raise ValueError(f"ray_address 'auto' {_AUTO_JOINS_ANY}; pass the cluster's host:port (or set RAY_ADDRESS), "
                         "start one with `ray start --head` and omit the address, or pass 'local'")
    quiet = dict(log_to_driver=worker_logs, logging_level="ERROR")
    _auto_init(True)  # as Ray has it, once a launch connects on purpose again (close() turned it off)
    if ray.is_initialized():
        with _SESSION_LOCK:
            if _OWN_SESSION["users"] > 0:  # opened here for an earlier launch still running: shared
                if (other := _another_cluster_asked(address)) is not None:
                    raise LaunchError(other)
                _OWN_SESSION["users"] += 1
                started = _OWN_SESSION["started_here"]
                return RayConnection(started_here=started, address=_OWN_SESSION["address"], joined_here=not started)
        if (elsewhere := _programs_session_elsewhere(address)) is not None:
            raise LaunchError(elsewhere)
        return RayConnection(started_here=False, address="existing session")
    if worker_logs:
        _plain_worker_prefixes_off_a_terminal()
    address, how = asked_cluster(address)
    if address == "auto":  # only from RAY_ADDRESS (the option was refused above): ray.init reads it itself
        raise LaunchError(f"RAY_ADDRESS 'auto' {_AUTO_JOINS_ANY}; set RAY_ADDRESS to the cluster's host:port, "
                          "unset it to use the cluster `ray start` recorded on this machine, or pass "
                          "--ray-address local for a private one")
    if address is not None:
        if (malformed := malformed_address(address)) is not None:  # RAY_ADDRESS, unchecked until now
            raise LaunchError(f"{malformed} (from {how})")
        if (elsewhere := remote_ray_client(address)) is not None:
            raise LaunchError(f"{address!r} ({how}) is Ray Client to another machine ({elsewhere}): the ranks stream "
                              f"tokens to a socket the driver opens here, which the cluster cannot reach through Ray "
                              f"Client; run the command on the cluster instead (`ray job submit -- corelaunch ...`, "
                              f"or on a node with --ray-address HEAD:6379)")
        fix = "start one with `ray start --head`, pass the right --ray-address, or pass --ray-address local for a private one"
        recorded = how.startswith("the cluster")
        if recorded:  # only then is there a record to forget
            fix += ("; to forget a recorded cluster that is gone, run `ray stop` (it also stops every Ray process "
                    "of this user on this host, other launches' private clusters included)")
        if recorded:
            # The cluster ray.init() itself would find: Ray turns token authentication on for it when
            # a token is at hand (a `ray start` after any ray.init() on this machine, which writes
            # ~/.ray/auth_token, has it on), and never for an address given outright. Before the
            # probe, so that it sends the token ray.init will.
            _token_auth_as_ray_does_for_a_found_cluster()
        # Ray sends its token only under RAY_AUTH_MODE=token (set above for the recorded cluster
        # where a token is at hand); the probe sends the same, so a wrong one is told at once.
        token = _token_metadata()
        unreachable = _unreachable(address, sends_token=bool(token), token=token)
        if unreachable == WRONG_TOKEN:
            raise LaunchError(_token_refused(address, how))
        if unreachable == TOKEN_NEEDED:
            raise LaunchError(_token_missing(address, how))
        if unreachable is not None:  # ray.init would retry a port nobody listens on for ever
            raise LaunchError(f"no Ray cluster answered at {address!r} ({how}; {unreachable}); {fix}")
        try:
            _init(address=address, **quiet)
        except ConnectionError as err:
            reasons = _error_chain_text(err)
            if _NO_NODE_HERE in reasons:  # the GCS answered (the probe above): Ray wants a raylet on this host
                raise LaunchError(f"the Ray cluster at {address!r} ({how}) answers, but this machine runs none of "
                                  f"its nodes, and a Ray driver joins a cluster through a node on its own machine: "
                                  f"run the command on a node of the cluster (on its head, or `ray job submit -- "
                                  f"corelaunch ...`), or pass --ray-address local for a private one") from None
            if _TOKEN_REFUSED_BY_RAY in reasons:  # where the probe did not tell (a TLS GCS is not probed)
                refused = _token_refused(address, how) if token else _token_missing(address, how)
                said = reasons[reasons.index(_TOKEN_REFUSED_BY_RAY):]  # its cause's traceback left out
                raise LaunchError(f"{refused} (Ray: {said.split('.')[0]})") from None
            if not _token_mode():
                # Ray's refusal of a missing token reads as any failed connection
                fix += ("; if the cluster runs with token authentication (`ray start` turns it on where "
                        "~/.ray/auth_token exists), set RAY_AUTH_MODE=token, with its token in ~/.ray/auth_token "
                        "or RAY_AUTH_TOKEN")
            raise LaunchError(f"no Ray cluster answered at {address!r} ({how}; {reasons}); {fix}") from None
        _opened(started_here=False, address=address)
        return RayConnection(started_here=False, address=address, joined_here=True)
    # address="local" said outright: without it ray.init joins a cluster that `ray start` recorded on
    # this host after the lookup above (another program's), and then refuses num_cpus.
    # (No node address: Ray 2.60 replaces 127.0.0.1 given as one with the host's own address.)
    _token_for_this_user_only()
    try:
        with _agent_port_left_to_the_os():
            _init(address="local", num_cpus=private_cluster_cpus(num_cpus), include_dashboard=False, **quiet)
    except Exception as err:
        logs = logs_dir()  # this start's own session, while Ray still knows it
        # Not where Ray refused because a session was already connected ("Maybe/Perhaps you called
        # ray.init twice"): one another thread opened meanwhile, which ray.shutdown() would end
        # under it. connect()'s lock keeps its own callers out of that race; the calling program's
        # own ray.init on another thread is not.
        if "called ray.init twice" not in str(err):
            try:
                ray.shutdown()  # whatever it did start
            except Exception:  # noqa: BLE001 - the start's own error is the one to report
                pass
        failure = private_start_failure(err, logs, open_files_limits())
        if failure is err:
            raise
        raise failure from err
    _token_for_this_user_only()  # the start writes it where none existed, readable by all (umask 022)
    _opened(started_here=True, address="local", dead_at_start=_dead_node_processes())
    return RayConnection(started_here=True, address="local")


_NO_NODE_HERE = "No node info found"
"""How Ray 2.60's driver says, after retrying for GCS_SERVER_REQUEST_TIMEOUT_SECONDS (60 s), that no
live raylet of the cluster it joins runs on its own machine (services.get_node_to_connect_for_driver)."""


_TOKEN_REFUSED_BY_RAY = "InvalidAuthToken"
"""How Ray's GCS names a token it refuses (missing or wrong) in the error ray.init raises."""


def _error_chain_text(err: BaseException) -> str:
    """err's text and that of the errors it was raised from, "; "-joined: ray.init's ConnectionError
    ("Failed to connect to Ray cluster at ...") says only that it failed, its cause why."""
    return "; ".join(str(link) or type(link).__name__ for link in error_chain(err))


RAY_OPEN_FILES = 4096
"""The open-files limit below which Ray 2.60 warns that its servers may fail to connect (a warning
`connect` hides, with Ray's other INFO and WARNING lines)."""


def open_files_limits() -> tuple[int, int]:
    """This process's open-files limits (soft, hard: `ulimit -n`, `ulimit -Hn`), as ray.init left
    them: Ray raises the soft one to the hard one, at most 65536."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)


def private_start_failure(err: Exception, logs: str, open_files: tuple[int, int]) -> Exception:
    """The error for ray.init's failure to start a private cluster, with what to change: a folder Ray
    cannot write or a socket path too long names the setting (exit 2); a start that failed or timed
    out with fewer open files allowed than Ray wants names the limit (exit 2: a retry never helps),
    else it is RayStartFailed (exit 3: the machine's state, a retry may work). Ray raised a bare
    Exception (its raylet not registered within 30 s) or a RuntimeError (its GCS port file not
    written in time): the RuntimeError was a traceback, and under `ulimit -n 32` or 48 both were
    blamed on a busy host."""
    text = str(err)
    if isinstance(err, UnicodeEncodeError):  # Ray's core worker encodes its session paths as ASCII
        folder = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
        return ValueError(f"the private Ray cluster did not start: {text}; Ray's temporary folder (TMPDIR, or "
                          f"RAY_TMPDIR: {folder}) must be a path of ASCII characters: point it at one, such as /tmp")
    if "AF_UNIX path length" in text:
        return ValueError(f"the private Ray cluster did not start: {text}; Ray's sockets live under its temporary "
                          f"folder (TMPDIR, or RAY_TMPDIR): point it at a shorter path, such as /tmp")
    if isinstance(err, PermissionError) or (isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM,
                                                                                        errno.EROFS)):
        return ValueError(f"the private Ray cluster did not start: {type(err).__name__}: {text}; Ray writes its "
                          f"session under its temporary folder (TMPDIR, or RAY_TMPDIR; /tmp by default) and its "
                          f"token under ~/.ray (HOME): point them at folders this user can write")
    soft, hard = open_files
    if soft < RAY_OPEN_FILES and type(err) in (Exception, RuntimeError, OSError):
        raise_it = ("`ulimit -n 65536`" if hard > soft else
                    f"the hard limit is {hard} too (`ulimit -Hn`): raising it needs root or the host's limits "
                    f"configuration")
        return ValueError(f"the private Ray cluster did not start ({type(err).__name__}: {text}), and this process "
                          f"may open only {soft} files (`ulimit -n`), below the {RAY_OPEN_FILES} under which Ray "
                          f"warns that its servers' connections may fail: raise the limit ({raise_it}) and run "
                          f"again; Ray's logs are in {logs}")
    if type(err) in (Exception, RuntimeError):
        return RayStartFailed(f"the private Ray cluster did not start: {text} Ray waits 30 s for it, which a host "
                              f"too busy to start its processes misses (look at `uptime`): retry when the host is "
                              f"quieter; Ray's logs are in {logs}")
    return err  # a bad option or a path: said as it is (exit 2)


def private_cluster_dying(within_s: float) -> bool:
    """True when a process of the private Ray this process started (its GCS, raylet, dashboard or
    log monitor) other than those gone when it had started (dead_when_started) has exited, waiting
    up to within_s for one to. A SIGTERM sent to the whole process group (`kill -- -PGID`, systemd
    stopping a unit, `timeout`) reaches Ray's processes as well as this one (Ray blocks only SIGINT
    in them), and then the cluster is going down under a graceful shutdown:
    Serve's waited 30 s for a controller that could no longer answer. False for a cluster this
    process did not start, or a Ray without the node record read here."""
    import time

    dead_before = dead_when_started()
    deadline = time.monotonic() + within_s
    while True:
        if dead_private_processes() - dead_before:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _ray_node():
    """Ray's record of the node this process started or joined (its session, its processes); None
    without one, or on a Ray that keeps it elsewhere (a private attribute)."""
    import ray

    return getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)


def logs_dir() -> str:
    """The logs folder of the Ray session this process started or joined. Ray's `session_latest`
    link names the newest session on the host, which on a shared host may be another user's or
    another program's; Ray's default place where this process has no session."""
    try:
        return str(_ray_node().get_logs_dir_path())
    except Exception:  # noqa: BLE001 - no session here, or an unknown Ray
        return "/tmp/ray/session_latest/logs"


def private_node_running() -> bool:
    """True once this process has started a private Ray whose record of its processes is readable."""
    node = _ray_node()
    return node is not None and bool(_OWN_SESSION["started_here"]) and hasattr(node, "dead_processes")


def dead_private_processes() -> frozenset[int]:
    """The pids of the private Ray's own processes (see private_cluster_dying) that have exited."""
    if not private_node_running():
        return frozenset()
    return _dead_node_processes()


def _dead_node_processes() -> frozenset[int]:
    """The pids of the exited processes of the node this process started, by Ray's record of them
    (empty on a Ray without it)."""
    node = _ray_node()
    if node is None or not hasattr(node, "dead_processes"):
        return frozenset()
    return frozenset(process.pid for _, process in node.dead_processes())


def dead_when_started() -> frozenset[int]:
    """dead_private_processes() as connect() found it once the private Ray had started: the
    baseline for private_cluster_dying where the caller took none of its own (the CLI's SIGTERM
    handler, for a Launcher's cluster). Without it, a process of Ray's that had exited on its own
    made a plain `kill PID` of the driver read as a signal to the whole group: exit 143 at once,
    the ranks and Ray not stopped. No lock: a signal handler reads it, on a main thread that may
    hold _SESSION_LOCK where the signal came."""
    return _OWN_SESSION["dead_at_start"] if _OWN_SESSION["started_here"] else frozenset()


@contextlib.contextmanager
def _agent_port_left_to_the_os():
    """A private cluster's dashboard agent on a port the OS picks, not Ray's fixed default (52365).
    With it on 52365, a cluster the user then started on this host (`ray start --head`) found the port
    taken, disabled its agent's HTTP service, and refused every `ray job submit` ("No available agent
    to submit job"). ray.init takes no option for this port, so the default of the parameter ray.init
    leaves out is set to 0 (any free port, as Ray's own multi-node test clusters use) while the
    private cluster starts; a Ray without that parameter is left as it is."""
    import inspect

    from ray._private.parameter import RayParams

    init = RayParams.__init__
    defaults = init.__defaults__ or ()
    optional = [p.name for p in inspect.signature(init).parameters.values() if p.default is not inspect.Parameter.empty]
    if "dashboard_agent_listen_port" not in optional or len(optional) != len(defaults):
        yield
        return
    index = optional.index("dashboard_agent_listen_port")
    init.__defaults__ = defaults[:index] + (0,) + defaults[index + 1:]
    try:
        yield
    finally:
        init.__defaults__ = defaults


def _plain_worker_prefixes_off_a_terminal() -> None:
    """Ray prints each forwarded worker line after a prefix in ANSI colours (`ESC[36m(rank 0
    pid=...)ESC[0m`) unless RAY_COLOR_PREFIX is "0", which its driver reads as it prints each line:
    in a log file the codes are noise, so off a terminal they are turned off, unless the user set
    the variable. Set before ray.init, so a private cluster's processes inherit it too."""
    from shardlib.terminal import stderr_is_a_terminal

    if not stderr_is_a_terminal():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _init(**options) -> None:
    """ray.init, with Ctrl-C held until it has returned and then shutting down what it started. A
    KeyboardInterrupt inside it (while a private cluster starts its processes) left a node no
    ray.shutdown() can reach (not yet Ray's global one) and the caller no connection to close:
    Ray's dashboard and runtime-env agents outlived the command by a minute or more. Where the CLI
    raises SIGTERM as an interrupt (launcher.termination), SIGTERM is held the same way, and its
    handler is put back over the ones ray.init installs. Not held while a join looks for a node of
    its cluster on this machine (up to 60 s where none runs), and never lost to ray.init's failure."""
    import signal

    import ray

    from launcher import termination

    if threading.current_thread() is not threading.main_thread():
        _init_on_a_keeper_thread(options)  # signals reach the main thread only
        return
    interrupted: list[int] = []
    lookup = _node_lookup_code()  # looked up now: a handler that raised mid ray.init stranded a start

    def hold(signum: int, frame) -> None:
        if signum == signal.SIGTERM:
            termination.note_held()  # sent to the whole group, it exits now: the GCS is going
        interrupted.append(signum)
        if signum == signal.SIGINT and lookup is not None and _inside(frame, lookup):
            raise KeyboardInterrupt  # handled below, as a held one

    sigterm_held = termination.installed()
    held = [signal.SIGINT] + ([signal.SIGTERM] if sigterm_held else [])
    previous = {sig: signal.signal(sig, hold) for sig in held}
    # checked as it comes, not once ray.init is back in the interpreter (termination's docstring)
    checked = termination.held_sigterm_checked_at_once() if sigterm_held else contextlib.nullcontext()
    try:
        with _sigterm_handler_kept(sigterm_held), checked:
            ray.init(**options)
    except BaseException as err:
        if signal.SIGTERM in interrupted:  # said as SIGTERM (exit 143), not as ray.init's failure
            termination.raise_after_hold()
        if signal.SIGINT in interrupted:
            # Ctrl-C while ray.init failed slowly (a join retries for up to 60 s): said as an
            # interrupt (exit 130), not lost behind ray.init's failure, which no caller sees now
            if "called ray.init twice" not in str(err):  # else another thread's session, not this one's
                _shut_down_quietly()
            raise KeyboardInterrupt
        raise
    finally:
        signal.signal(signal.SIGINT, previous[signal.SIGINT])
        if sigterm_held:
            # over `hold`, and over Ray's own where a Ray installed them despite _sigterm_handler_kept
            # (its sys.exit(15); its core worker's C++ failure handler, which dumped a stack and
            # aborted, exit 134)
            termination.reinstall()
    if interrupted:
        _shut_down_quietly()
        if signal.SIGTERM in interrupted:
            termination.raise_after_hold()
        raise KeyboardInterrupt


def _shut_down_quietly() -> None:
    """ray.shutdown() after a held signal: a failure of it must not replace the interrupt, which is
    what the caller is told (exit 130 or 143)."""
    import ray

    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - the interrupt is raised next
        pass


def _node_lookup_code():
    """The code of Ray's driver looking for a raylet of the cluster it joins on this machine
    (retrying for up to 60 s where none runs; Ray 2.60's services.get_node_to_connect_for_driver),
    or None where this Ray has no such function: Ctrl-C is then held throughout, as before."""
    try:
        import ray._private.services as services
    except ImportError:  # a Ray that moved it: held throughout too
        return None
    return getattr(getattr(services, "get_node_to_connect_for_driver", None), "__code__", None)


def _inside(frame, code) -> bool:
    """Whether frame runs `code` or is called from it: inside the lookup for a node here, which has
    started nothing an interrupt could strand, so Ctrl-C needs no holding."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _sigterm_handler_kept(keep: bool):
    """ray.init's own SIGTERM handlers (the driver's `sys.exit(15)`, set as it begins, and a head
    node's kill-everything-then-exit-1) not installed inside the block, so a SIGTERM while a
    private cluster starts is held like Ctrl-C; a Ray without the function it installs them
    through keeps them. Nor the C++ failure handler its core worker installs (Ray's
    RAY_DISABLE_FAILURE_SIGNAL_HANDLER, read as the core worker starts: set here as Ray's module
    constant, not in the environment, which Ray's own processes inherit): it takes SIGTERM too, and
    a SIGTERM while the core worker registered with its raylet dumped a stack and aborted 3 s later
    (exit 134). The driver keeps Python's faulthandler for a crash, which ray.init enables."""
    import ray._private.ray_constants as ray_constants
    import ray._private.utils as ray_utils

    if not keep:
        yield
        return
    install = getattr(ray_utils, "set_sigterm_handler", None)
    if install is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    failure_handler_off = getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", False)
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        if install is not None:
            ray_utils.set_sigterm_handler = install
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = failure_handler_off


_KEEPER_RELEASE: list[threading.Event] = []
"""The event the thread that ran ray.init waits on, set once the session is shut down."""


def _init_on_a_keeper_thread(options: dict) -> None:
    """ray.init on a thread that lives until the session is shut down. Ray starts a private
    cluster's processes with PR_SET_PDEATHSIG, which Linux sends when the parent *thread* exits:
    started from a thread that then ended (a Launcher started on a worker thread), its GCS and
    raylet died within seconds, and Ray killed the whole process a minute later, unable to reach
    its GCS."""
    import ray

    release, started, failure = threading.Event(), threading.Event(), []

    def keep() -> None:
        try:
            ray.init(**options)
        except BaseException as err:  # noqa: BLE001 - raised again on the caller's thread
            failure.append(err)
            return
        finally:
            started.set()
        release.wait()

    _KEEPER_RELEASE.append(release)
    threading.Thread(target=keep, name="corelaunch-ray-session", daemon=True).start()
    started.wait()
    if failure:
        _KEEPER_RELEASE.remove(release)
        raise failure[0]


def _release_keepers() -> None:
    while _KEEPER_RELEASE:
        _KEEPER_RELEASE.pop().set()


def _opened(started_here: bool, address: str, dead_at_start: frozenset[int] = frozenset()) -> None:
    with _SESSION_LOCK:  # one update: dead_when_started reads it without the lock
        _OWN_SESSION.update(users=1, started_here=started_here, address=address, dead_at_start=dead_at_start)


def _token_for_this_user_only() -> None:
    """Ray's token file, and the ~/.ray folder it is written in, for their owner alone. Ray writes
    the token with the umask's mode (0644 in a 0755 ~/.ray) early in a private start: on a host whose
    home directories others can enter, any local user could read it (for the seconds until a chmod
    after the start, or for good), and with it call the private cluster's servers (Serve's gRPC port
    unpickles what it is sent). So the folder is made 0700 first, the file 0600 after. Another
    user's file or folder, or a symlink, is left alone."""
    try:  # where Ray keeps it (read at each call: HOME may change)
        folder = Path.home() / ".ray"
    except RuntimeError:  # no home directory to find
        return
    with contextlib.suppress(OSError):  # there already (checked below), or no home to make it in
        os.mkdir(folder, 0o700)
    for path, flags, mode in ((folder, os.O_DIRECTORY, 0o700), (folder / "auth_token", 0, 0o600)):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | flags)
        except OSError:  # none yet, or a symlink
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid == os.getuid() and st.st_mode & 0o077 and (flags or stat.S_ISREG(st.st_mode)):
                os.fchmod(fd, mode)
        except OSError:  # a file system without modes
            pass
        finally:
            os.close(fd)


def _token_auth_as_ray_does_for_a_found_cluster() -> None:
    """Ray's own step when ray.init() finds a local cluster without being given its address: token
    authentication on if RAY_AUTH_MODE is unset and a token is at hand (ray._private: absent in
    another Ray, nothing is done and a refused connection says what to set)."""
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)

