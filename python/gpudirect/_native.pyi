from typing import List, Optional, Tuple

class GpudirectError(Exception):
    """Base class of every error gpudirect raises."""

class DoctorError(GpudirectError):
    """The doctor could not run: an input could not be read, or a capture written."""

def doctor(
    *,
    env_file: Optional[str] = None,
    pid: Optional[int] = None,
    nccl_log: Optional[str] = None,
    capture: Optional[str] = None,
    from_capture: Optional[str] = None,
    gpu: Optional[int] = None,
    device: Optional[str] = None,
    verbose: bool = False,
) -> Tuple[str, str, int]:
    """(JSON report, the text the command prints, its exit status)."""

def explain_nccl_log(text: str) -> Tuple[str, str, int]:
    """(JSON report, the text the command prints, its exit status)."""

class EngineError(GpudirectError):
    """A transfer-engine error; the message is the Rust EngineError's."""

class Agent:
    def __init__(
        self,
        name: str,
        *,
        devices: Optional[List[str]] = None,
        listen: Optional[str] = None,
        secret_file: Optional[str] = None,
        insecure: bool = False,
        timeout: float = 30.0,
    ) -> None: ...
    def _register_raw(self, name: str, addr: int, len: int, keep: object) -> int: ...
    def deregister(self, name: str) -> None: ...
    def metadata(self) -> bytes: ...
    def load_remote(self, md: bytes) -> str: ...
    def prepare(
        self, op: str, entries: List[Tuple[str, int, str, str, int, int]], notify: Optional[bytes] = None
    ) -> "Request": ...
    def notifications(self) -> List[Tuple[str, bytes]]: ...
    def wait_notification(self, timeout: Optional[float] = None) -> Tuple[str, bytes]: ...

class Request:
    def post(self) -> None: ...
    def status(self) -> str: ...
    def wait(self, timeout: Optional[float] = None) -> None: ...
