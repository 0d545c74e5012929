"""OpenAI's Batch API on `offload serve`: files (upload, list, object, content, delete) and batches (create,
retrieve, list, cancel). Each batch is a job in the state folder:

    <state_dir>/files/<file id>, <file id>.json         uploads, and each batch's output and error files
    <state_dir>/batches/<batch id>/batch.json            the batch object (written whole, atomically)
    <state_dir>/batches/<batch id>/input.jsonl           a copy of its input file
    <state_dir>/batches/<batch id>/log.jsonl             the job engine's output log: answers and failed lines

A batch runs on the served model (batch_runner.py) behind interactive requests; at startup every batch not in a
final state resumes, skipping what its output log already answers. When it ends, the log is split into OpenAI's
output file (answers) and error file (failed lines). A batch still running when its completion window ends stops:
expired, with its answers in its output file and each request it did not answer in its error file (OpenAI's
batch_expired); a server that was down then expires it as it resumes."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from offload.jobs.batch import URLS, error_record
from offload.jobs.output import record_key
from offload.serve import files
from offload.serve.batch_runner import LOG_NAME, BatchRunner
from offload.serve.files import FileStore, derived_file_id, write_json_atomic
from offload.serve.protocol import ApiError, read_json

logger = logging.getLogger("offload")

BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
# a completion_window: OpenAI's "24h", or another whole number of seconds, minutes, hours or days ("30m", "7d")
COMPLETION_WINDOW = re.compile(r"([1-9][0-9]{0,5})([smhd])")
WINDOW_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
EXPIRED = "batch_expired"  # OpenAI's error code of a request whose batch's window ended before it was answered
FILES_LIMIT_MAX = 10_000  # GET /v1/files?limit= (OpenAI's bound and default)
FINAL = ("completed", "failed", "cancelled", "expired")
LIST_LIMIT_MAX, LIST_LIMIT_DEFAULT = 100, 20  # GET /v1/batches?limit= (OpenAI's bounds)
METADATA_MAX_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's
NOT_RUN = "batch_failed"  # the error code of a request a failed batch did not run (OpenAI's expired: batch_expired)


class Batches:
    """The batches of one state folder: their objects (cached, written through) and the runners of live ones."""

    def __init__(self, state_dir: Path, server, clock: Callable[[], float] = time.time):
        """clock: the time in seconds since the epoch that stamps the batches and ends their windows (tests pass
        their own)."""
        self.folder = state_dir / "batches"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.files = FileStore(state_dir / "files")
        self.server, self.clock = server, clock
        self._lock = threading.Lock()  # the objects and their files
        self._inputs = threading.Lock()  # a file is not deleted between a batch's check of it and its own copy
        self._ending = threading.Lock()  # one finalize at a time: a cancel may race a runner's own end
        self._objects: dict[str, dict] = {}
        self._runners: dict[str, BatchRunner] = {}
        for path in sorted(self.folder.glob("batch_*/batch.json")):
            try:
                obj = json.loads(path.read_text())
                self._objects[obj["id"]] = obj
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.error(f"{path} is not a batch object ({type(e).__name__}: {e}); that batch is left out")

    def resume(self) -> None:
        """Start (again) every batch not in a final state: at server start, once the engine thread runs."""
        for batch_id, obj in sorted(self._objects.items(), key=lambda item: item[1]["created_at"]):
            if obj["status"] == "cancelling":
                self.finalize(batch_id, "cancelled")
            elif obj["status"] not in FINAL:
                logger.info(f"resuming batch {batch_id} ({obj['status']})")
                self._start(obj)

    def stop(self) -> None:
        """The server stops: every runner leaves its batch as it stands."""
        for runner in list(self._runners.values()):
            runner.stop()

    def create(self, body) -> dict:
        """POST /v1/batches: check the body and the input file, copy the input, start the batch."""
        if not isinstance(body, dict):
            raise ApiError(400, f"expected the request body to be a JSON object, found {type(body).__name__}")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in URLS:
            raise ApiError(400, f"expected 'endpoint' to be one of {', '.join(URLS)} (what this server answers), "
                                f"found {endpoint!r}", "endpoint")
        window_s, metadata = completion_window_s(window), _check_metadata(body.get("metadata"))
        with self._inputs:
            source = self.files.info(body.get("input_file_id"))
            if source["purpose"] != "batch":
                raise ApiError(400, f"the file {source['id']} has purpose {source['purpose']!r}; a batch's input "
                                    f"must be uploaded with purpose 'batch'", "input_file_id")
            obj = self._new_batch(endpoint, window, window_s, source["id"], metadata)
        self._start(obj)
        return self.get(obj["id"])

    def _new_batch(self, endpoint: str, window: str, window_s: int, input_file_id: str, metadata) -> dict:
        """The folder, input copy and object of a new batch, saved."""
        batch_id, now = f"batch_{secrets.token_hex(12)}", self._now()
        folder = self.folder / batch_id
        folder.mkdir()
        _copy(self.files.content_path(input_file_id), folder / "input.jsonl")
        obj = {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
               "input_file_id": input_file_id, "completion_window": window, "status": "validating",
               "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
               "expires_at": now + window_s, "finalizing_at": None, "completed_at": None, "failed_at": None,
               "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
               "model": self.server.model_name}
        self._save(obj)
        return obj

    def get(self, batch_id: str) -> dict:
        """The batch object, its counts read from its running job where it runs; ApiError 404 if unknown."""
        with self._lock:
            obj = self._objects.get(batch_id) if isinstance(batch_id, str) and BATCH_ID.fullmatch(batch_id) else None
            if obj is None:
                raise ApiError(404, f"no batch with id {str(batch_id)[:80]!r} on this server (GET /v1/batches "
                                    f"lists them)", code="batch_not_found")
            runner = self._runners.get(batch_id)
            counts = runner.counts() if runner is not None and obj["status"] in ("in_progress", "cancelling") else None
            return {**obj, "request_counts": counts or obj["request_counts"]}

    def page(self, after: str | None, limit: int) -> dict:
        """GET /v1/batches: newest first, limit of them after the id `after`."""
        with self._lock:
            ids = [o["id"] for o in sorted(self._objects.values(), key=lambda o: (-o["created_at"], o["id"]))]
        start = ids.index(after) + 1 if after in ids else 0
        data = [self.get(i) for i in ids[start: start + limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ids)}

    def cancel(self, batch_id: str) -> dict:
        """POST /v1/batches/{id}/cancel: cancelling now, cancelled once what is in flight is aborted."""
        obj = self.get(batch_id)
        if obj["status"] in FINAL or obj["status"] == "cancelling":
            if obj["status"] == "cancelled" or obj["status"] == "cancelling":
                return obj
            raise ApiError(409, f"batch {batch_id} is {obj['status']} and cannot be cancelled", code="batch_ended")
        self._update(batch_id, status="cancelling", cancelling_at=self._now())
        runner = self._runners.get(batch_id)
        if runner is not None and runner.alive:
            runner.cancel()
        else:
            self.finalize(batch_id, "cancelled")
        return self.get(batch_id)

    def delete_file(self, file_id: str) -> dict:
        """DELETE /v1/files/{id}: gone, unless a batch that has not ended reads it (409)."""
        with self._inputs, self._lock:
            reader = next((o for o in self._objects.values()
                           if o["input_file_id"] == file_id and o["status"] not in FINAL), None)
            if reader is not None:
                raise ApiError(409, f"the file {file_id} is the input of batch {reader['id']}, which is "
                                    f"{reader['status']}; cancel the batch or let it end, then delete the file",
                               code="file_in_use")
            self.files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # --- what runners report and ask -----------------------------------------------------------------------------

    def past_window(self, batch_id: str) -> bool:
        """Whether the batch's completion window has ended (by the clock)."""
        return self.clock() >= self._objects[batch_id]["expires_at"]

    def started(self, batch_id: str, counts: dict) -> None:
        obj = self._objects[batch_id]
        if obj["status"] == "validating":
            self._update(batch_id, status="in_progress", in_progress_at=self._now(), request_counts=counts)
        else:
            self._update(batch_id, request_counts=counts)

    def fail(self, batch_id: str, message: str) -> None:
        """The batch cannot run (its input, or a resume under another model): failed, with the reason."""
        logger.error(f"batch {batch_id} failed: {message}")
        self._update(batch_id, status="failed", failed_at=self._now(),
                     errors={"object": "list", "data": [{"code": "invalid_batch", "message": message,
                                                         "param": None, "line": None}]})

    def finalize(self, batch_id: str, status: str, failure: str | None = None, items: list = ()) -> None:
        """Split the output log into the output file (answers) and the error file (failed lines), count them,
        and end the batch with status: completed; cancelled, with what was answered before; failed (failure: why it
        stopped partway) or expired (its window ended), with what was answered and, in the error file, each of
        items (its requests) not answered. Where those files cannot be written (a full disk), the batch is left as
        it stands, to resume at the next start."""
        with self._ending:
            obj = self._objects[batch_id]
            if obj["status"] in FINAL:
                return
            if status == "completed":
                self._update(batch_id, status="finalizing", finalizing_at=self._now())
            try:
                counts = self._split(batch_id, items, *_not_run(status, failure, obj["completion_window"]))
                ids = self._adopt_outputs(batch_id)
                not_run = counts.pop("not_run")
                counts["failed"] += not_run
                counts["total"] = max(obj["request_counts"]["total"], sum(counts.values()))
                self._update(batch_id, **ids, **_ending_fields(status, self._now(), failure, counts, not_run),
                             request_counts=counts)
            except OSError as e:
                self._remove_outputs(batch_id)
                logger.error(f"batch {batch_id} {'stopped (' + failure + ') and ' if failure else ''}cannot write "
                             f"its output files ({e.strerror or e}); it is left {self._objects[batch_id]['status']} "
                             f"and resumes when the server next starts, skipping what its log answers")

    # --- inside ------------------------------------------------------------------------------------------------

    def _start(self, obj: dict) -> None:
        runner = BatchRunner(obj, self.folder / obj["id"], self.server, self)
        self._runners[obj["id"]] = runner
        runner.start()

    def _split(self, batch_id: str, items: list, code: str, message: str) -> dict:
        """The output log's whole records into output.jsonl (answers) and error.jsonl (failed lines) beside it,
        line by line, then an error line (code, message) for each of items the log does not hold (a batch that
        failed partway or expired); how many went to each."""
        folder, counts, seen = self.folder / batch_id, {"completed": 0, "failed": 0, "not_run": 0}, set()
        log = folder / LOG_NAME
        if not log.exists():
            log.touch()  # a batch cancelled before its runner wrote anything
        with open(log, "rb") as records, open(folder / "output.jsonl", "wb") as ok, \
                open(folder / "error.jsonl", "wb") as failed:
            for line in records:
                if not line.endswith(b"\n") or not line.strip():  # a torn last line: its request was never answered
                    continue
                record = json.loads(line)
                seen.add(record_key(record))
                answered = record.get("error") is None
                (ok if answered else failed).write(line)
                counts["completed" if answered else "failed"] += 1
            for item in (i for i in items if i.key not in seen):
                failed.write((json.dumps(error_record(item, message, code), ensure_ascii=False) + "\n").encode())
                counts["not_run"] += 1
        return counts

    def _adopt_outputs(self, batch_id: str) -> dict:
        """Move output.jsonl and error.jsonl into the file store (an empty one is none); their file ids."""
        ids = {}
        for kind in ("output", "error"):
            path, ids[f"{kind}_file_id"] = self.folder / batch_id / f"{kind}.jsonl", None
            if path.stat().st_size:
                ids[f"{kind}_file_id"] = self.files.adopt(path, f"{batch_id}_{kind}.jsonl", "batch_output",
                                                          derived_file_id(f"{batch_id}:{kind}"))["id"]
            path.unlink(missing_ok=True)
        return ids

    def _remove_outputs(self, batch_id: str) -> None:
        for kind in ("output", "error"):
            (self.folder / batch_id / f"{kind}.jsonl").unlink(missing_ok=True)

    def _now(self) -> int:
        return int(self.clock())

    def _update(self, batch_id: str, **fields) -> None:
        with self._lock:
            obj = {**self._objects[batch_id], **fields}
            write_json_atomic(self.folder / batch_id / "batch.json", obj)
            self._objects[batch_id] = obj

    def _save(self, obj: dict) -> None:
        with self._lock:
            write_json_atomic(self.folder / obj["id"] / "batch.json", obj)
            self._objects[obj["id"]] = obj


def _not_run(status: str, failure: str | None, window: str) -> tuple[str, str]:
    """The error code and message of a request a batch that ended with status did not answer."""
    if status == "expired":
        return EXPIRED, (f"not run: the batch's completion window ({window}) ended before this request was answered; "
                         f"send it again in a new batch")
    return NOT_RUN, f"not run: the batch stopped ({failure}); send this request again"


def _ending_fields(status: str, now: int, failure: str | None, counts: dict, not_run: int) -> dict:
    """The fields a batch ends with: completed, cancelled, expired, or failed partway, saying where its requests
    are."""
    if status != "failed":
        return {"status": status, f"{status}_at": now}
    message = (f"the batch stopped partway ({failure}): its {counts['completed']} answers are in its output file, "
               f"and its error file holds its {counts['failed'] - not_run} failed lines and the {not_run} requests "
               f"it did not run (code {NOT_RUN!r}): send those again")
    return {"status": "failed", "failed_at": now, "errors": {"object": "list", "data": [
        {"code": NOT_RUN, "message": message, "param": None, "line": None}]}}


def completion_window_s(window) -> int:
    """The seconds of a completion_window ("24h"); ApiError 400 for anything but a whole number and a unit."""
    match = COMPLETION_WINDOW.fullmatch(window) if isinstance(window, str) else None
    if match is None:
        raise ApiError(400, f"expected 'completion_window' to be a duration such as '24h' (OpenAI's), '90m' or '7d' "
                            f"(a whole number and s, m, h or d), found {window!r:.80}", "completion_window")
    return int(match[1]) * WINDOW_UNIT_S[match[2]]


def _copy(source: Path, target: Path) -> None:
    """A batch's own copy of its input: a hard link where the file system allows (stored files are only ever
    replaced whole, never changed in place), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _check_metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_MAX_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= METADATA_KEY_CHARS and
            len(v) <= METADATA_VALUE_CHARS for k, v in metadata.items()):
        raise ApiError(400, f"expected 'metadata' to be at most {METADATA_MAX_KEYS} string keys of at most "
                            f"{METADATA_KEY_CHARS} characters with string values of at most {METADATA_VALUE_CHARS}",
                       "metadata")
    return metadata


def add_batch_routes(app: FastAPI, server, auth: list) -> None:
    """The files and batches routes; without a state folder each answers 400 saying how to start the server."""

    def batches() -> Batches:
        if server.batches is None:
            raise ApiError(400, "the Batch API keeps its files and batches in the server's state folder, and this "
                                "server has none; start offload serve with --state-dir FOLDER")
        return server.batches

    @app.post("/v1/files", dependencies=auth)
    async def create_file(request: Request):
        return await files.upload(request, batches().files, server.max_upload_bytes)

    @app.get("/v1/files", dependencies=auth)
    async def list_files(purpose: str | None = None, after: str | None = None, limit: int = FILES_LIMIT_MAX,
                         order: str = "desc"):
        if not 1 <= limit <= FILES_LIMIT_MAX:
            raise ApiError(400, f"expected 'limit' from 1 to {FILES_LIMIT_MAX}, found {limit}", "limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"expected 'order' to be asc or desc (by created_at), found {order!r:.80}", "order")
        return batches().files.page(purpose, after, limit, newest_first=order == "desc")

    @app.get("/v1/files/{file_id}", dependencies=auth)
    async def retrieve_file(file_id: str):
        return batches().files.info(file_id)

    @app.delete("/v1/files/{file_id}", dependencies=auth)
    async def delete_file(file_id: str):
        return batches().delete_file(file_id)

    @app.get("/v1/files/{file_id}/content", dependencies=auth)
    async def file_content(file_id: str):
        return FileResponse(batches().files.content_path(file_id), media_type="application/octet-stream")

    @app.post("/v1/batches", dependencies=auth)
    async def create_batch(request: Request):
        store = batches()
        return store.create(await read_json(request))

    @app.get("/v1/batches", dependencies=auth)
    async def list_batches(after: str | None = None, limit: int = LIST_LIMIT_DEFAULT):
        if not 1 <= limit <= LIST_LIMIT_MAX:
            raise ApiError(400, f"expected 'limit' from 1 to {LIST_LIMIT_MAX}, found {limit}", "limit")
        return batches().page(after, limit)

    @app.get("/v1/batches/{batch_id}", dependencies=auth)
    async def retrieve_batch(batch_id: str):
        return batches().get(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=auth)
    async def cancel_batch(batch_id: str):
        return batches().cancel(batch_id)
