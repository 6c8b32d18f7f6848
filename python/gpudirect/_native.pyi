from typing import Optional, Tuple

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
