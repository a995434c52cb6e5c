"""Storage: one API over local directories and S3, plus the checksums both sides agree on."""

from core.files import sha256_file
from storage.store import IntegrityError, LocalStore, S3Store, Store, open_store

__all__ = ["IntegrityError", "LocalStore", "S3Store", "Store", "open_store", "sha256_file"]
