"""A checkpoint root by what a user passes: a local directory or an ``s3://bucket/prefix`` URL.

``load()`` and the command line both open what they are given here, so the two never disagree
about which strings name an object store, or what a usable local root is.
"""

from __future__ import annotations

import os
from typing import Optional, Union

from .base import Storage
from .local import LocalStorage
from .remote import ObjectStorage, check_remote_url, is_remote
from ..errors import CheckpointDirError


def open_storage(location: Union[str, os.PathLike, Storage],
                 options: Optional[dict] = None) -> Storage:
    """The Storage ``location`` names: an ``ObjectStorage`` for an ``s3://`` URL (checked first;
    settings from ``options``, else the AWS environment), a ``LocalStorage`` for a directory that
    exists (CheckpointDirError otherwise; made absolute, as messages show it), or ``location``
    itself when it already is a Storage."""
    if isinstance(location, Storage):
        return location
    location = os.fspath(location)
    if is_remote(location):
        check_remote_url(location)
        return ObjectStorage(location, options)
    if not os.path.isdir(location):
        state = "is not a directory" if os.path.exists(location) else "does not exist"
        raise CheckpointDirError(f"{location} {state}; pass the directory given to "
                                 "CheckpointEngine (the one that holds manifest.json), or the "
                                 "s3://bucket/prefix URL given as its remote")
    return LocalStorage(os.path.abspath(location))
