"""gcp-storage-emulator as tensorstore (orbax's array writer) needs it: media downloads carry the object's
`x-goog-generation` header, as real GCS sends it (without it tensorstore fails: "Malformed
StorageGeneration"). Run as the emulator's command line: `python gcs_emulator.py start --port P ...`.
"""

from __future__ import annotations

import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
  """The emulator's download, with GCS's generation headers."""
  try:
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
  except Exception:  # noqa: BLE001 - a missing object: the emulator's own handler answers 404
    obj = None
  if obj:
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
  return _download(request, response, storage, *args, **kwargs)


objects.download = download  # before the server module builds its handler table

from gcp_storage_emulator.__main__ import main  # noqa: E402 - after the patch above

if __name__ == "__main__":
  sys.exit(main())
