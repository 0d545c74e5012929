"""The Batch API's file store in the server's state folder: `files/<id>` holds a file's bytes and `files/<id>.json`
its OpenAI file object (id, bytes, created_at, filename, purpose); a file is there while its object is (written
after its bytes, removed before them; bytes without an object are swept at start). Ids are made here (`file-` and
24 hex digits) and any id a client sends is matched against that pattern before a path is built from it, so no id
reaches outside the folder. Uploads are read as they arrive and refused (413) once past the server's limit."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import BinaryIO

from starlette.datastructures import UploadFile
from starlette.requests import Request

from offload.serve.protocol import ApiError
from offload.units import format_bytes

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
UPLOAD_PURPOSES = ("batch",)  # what POST /v1/files takes; batch_output is the server's own (answers, errors)
FORM_SLACK_BYTES = 64 * 1024  # a multipart body's bytes beyond the file itself: boundaries, part headers, purpose
COPY_CHUNK_BYTES = 1 << 20


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def derived_file_id(seed: str) -> str:
    """The same id for the same seed (a batch's output file is rewritten, not duplicated, if finalizing reruns)."""
    return f"file-{hashlib.sha256(seed.encode()).hexdigest()[:24]}"


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON into a temporary file beside path, flushed to disk, then renamed over it: a reader (or a server
    killed mid-write) sees the old object or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    """Files by id under one folder; each is written to a temporary name and renamed into place once whole."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._sweep()

    def _sweep(self) -> None:
        """Remove what a server killed mid-write left: temporary files, and bytes whose object was never written
        (an upload never answered, a batch output its batch writes again as it resumes) or was deleted."""
        for path in self.folder.iterdir():
            if (path.name.startswith(".") and path.name.endswith(".tmp")) or \
                    (FILE_ID.fullmatch(path.name) and not path.with_name(f"{path.name}.json").exists()):
                path.unlink(missing_ok=True)

    def info(self, file_id: str) -> dict:
        """The file object of an id; ApiError 404 for an id that is malformed or not stored."""
        meta = self._meta_path(file_id)
        try:
            return json.loads(meta.read_text())
        except (OSError, ValueError):
            raise _no_such_file(file_id) from None

    def page(self, purpose: str | None, after: str | None, limit: int, newest_first: bool = True) -> dict:
        """GET /v1/files: the file objects (of one purpose, if given) by created_at, limit of them after the id
        `after`, in OpenAI's list shape."""
        objs = []
        for meta in self.folder.glob("file-*.json"):
            with contextlib.suppress(OSError, ValueError):  # deleted as it was listed
                objs.append(json.loads(meta.read_text()))
        objs = sorted((o for o in objs if purpose is None or o["purpose"] == purpose),
                      key=lambda o: (o["created_at"], o["id"]), reverse=newest_first)
        ids = [o["id"] for o in objs]
        start = ids.index(after) + 1 if after in ids else 0
        data = objs[start: start + limit]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(objs)}

    def delete(self, file_id: str) -> None:
        """Remove a file: its object first (from then on it is gone, to a reader and to a restart), then its bytes;
        ApiError 404 for an id that is malformed or not stored."""
        try:
            self._meta_path(file_id).unlink()
        except FileNotFoundError:
            raise _no_such_file(file_id) from None
        (self.folder / file_id).unlink(missing_ok=True)

    def content_path(self, file_id: str) -> Path:
        self.info(file_id)
        return self.folder / file_id

    def add(self, source: BinaryIO, filename: str, purpose: str, file_id: str | None = None) -> dict:
        """Store the bytes read from source under a new id (or the given one, replaced); its file object."""
        file_id = file_id or new_file_id()
        tmp = self.folder / f".{file_id}.tmp"
        with open(tmp, "wb") as f:
            shutil.copyfileobj(source, f, COPY_CHUNK_BYTES)
            f.flush()
            os.fsync(f.fileno())
        return self.adopt(tmp, filename, purpose, file_id)

    def adopt(self, path: Path, filename: str, purpose: str, file_id: str | None = None) -> dict:
        """Move a whole file (on the same file system) in under a new id, or the given one; its file object."""
        file_id = file_id or new_file_id()
        n_bytes = path.stat().st_size
        os.replace(path, self.folder / file_id)
        obj = {"id": file_id, "object": "file", "bytes": n_bytes, "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
               "status_details": None}
        write_json_atomic(self._meta_path(file_id), obj)
        return obj

    def _meta_path(self, file_id: str) -> Path:
        if not isinstance(file_id, str) or not FILE_ID.fullmatch(file_id):
            raise _no_such_file(file_id)
        return self.folder / f"{file_id}.json"


def _no_such_file(file_id) -> ApiError:
    return ApiError(404, f"no file with id {str(file_id)[:80]!r} on this server; file ids look like "
                         f"file-<24 hex digits>, as POST /v1/files and a batch's output_file_id give them",
                    code="file_not_found")


async def upload(request: Request, store: FileStore, max_bytes: int) -> dict:
    """POST /v1/files: a multipart form with `file` and `purpose` (batch); read as it arrives, refused with 413
    once it passes max_bytes (plus the form's own few bytes), and stored whole or not at all."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes + FORM_SLACK_BYTES:
        raise _too_large(max_bytes)
    seen = 0

    async def receive():
        nonlocal seen
        message = await request.receive()
        seen += len(message.get("body", b""))
        if seen > max_bytes + FORM_SLACK_BYTES:
            raise _too_large(max_bytes)
        return message

    try:
        form = await Request(request.scope, receive).form(max_files=1, max_fields=8)
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 (starlette's parser raises its own kinds for a malformed body)
        raise ApiError(400, f"expected a multipart/form-data body with the fields 'file' and 'purpose' "
                            f"({getattr(e, 'detail', e)})") from None
    async with _closing(form):
        file, purpose = form.get("file"), form.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise ApiError(400, f"expected 'purpose' to be one of {', '.join(UPLOAD_PURPOSES)} (the only kind of "
                                f"file this server uses), found {purpose!r}", "purpose")
        if not isinstance(file, UploadFile):
            raise ApiError(400, "expected the form field 'file' to hold the file's bytes (a file part)", "file")
        if file.size is not None and file.size > max_bytes:
            raise _too_large(max_bytes)
        return await asyncio.to_thread(store.add, file.file, Path(file.filename or "upload.jsonl").name, purpose)


@contextlib.asynccontextmanager
async def _closing(form):
    try:
        yield
    finally:
        await form.close()


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the file is larger than this server's upload limit of {format_bytes(max_bytes)} "
                         f"({max_bytes} bytes); split it into smaller batches, or start the server with a larger "
                         f"--max-upload", "file", "file_too_large")
