"""Checkpoint errors' text for the operating system's failures.

The checkpoint errors themselves (:class:`~dtensor_fp8.CheckpointError` and its kinds) and how a
failure on one rank becomes the same error on every rank (``agree``) live in
``dtensor_fp8/agreement.py``, the one home of cross-rank decisions (loads outside this package use
them too).
"""

from __future__ import annotations

def os_error_text(err: OSError, file=None) -> str:
    """``err`` as a sentence naming its errno (``ENOSPC``), the file, and for a full or read-only
    file system the free space and the fix.

    Example:
        >>> os_error_text(OSError(28, "No space left on device"), "ckpt/.step-00000002.partial/__0_0.distcp")
    """
    import errno as errno_names
    import os

    file = os.fspath(file) if file is not None else getattr(err, "filename", None)
    code = errno_names.errorcode.get(err.errno, f"errno {err.errno}") if err.errno else type(err).__name__
    text = f"{code} ({err.strerror or err})" + (f" on {file}" if file else "")
    if err.errno in (errno_names.ENOSPC, errno_names.EDQUOT) and file:
        where = os.path.dirname(os.fspath(file)) or "."
        try:
            st = os.statvfs(where)
            free = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
        except OSError:
            free = "free space unknown"
        text += (f": the file system (or quota) holding {where} is full ({free}). Fix: free space there or save "
                 "into a root on another file system")
    elif err.errno == errno_names.EIO:
        text += ": the device or network file system failed the operation; check it (dmesg, the storage's status)"
    elif err.errno == errno_names.EROFS:
        text += ": the file system is mounted read-only"
    return text
