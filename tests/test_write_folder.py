"""``datasets.locations.write_folder`` on local disk: a folder appears whole or not at all, and a
complete folder that a concurrent writer put there first is left to the runs reading it (two
trials of a sweep building one content-keyed validation store found its files deleted under
them when the second writer replaced it)."""

from pathlib import Path

from datasets.locations import write_folder

MANIFEST = "manifest.json"


def _writer(text: str, during=lambda: None):
    def fill(folder: Path) -> None:
        (folder / "rows.bin").write_text(text)
        during()  # another writer may finish here
        (folder / MANIFEST).write_text(text)

    return fill


def test_a_complete_folder_written_meanwhile_is_kept_and_ours_dropped(tmp_path):
    location = tmp_path / "store"
    readers = []

    def the_other_writer_finishes_and_a_run_opens_it():
        write_folder(location, _writer("first"), last=MANIFEST)
        readers.append((location / "rows.bin").open())

    write_folder(
        location, _writer("second", the_other_writer_finishes_and_a_run_opens_it), MANIFEST
    )
    assert (location / MANIFEST).read_text() == "first"
    assert (location / "rows.bin").read_text() == "first"
    assert readers[0].read() == "first"  # the reader's file is still the one it opened
    readers[0].close()
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # no staging folder left


def test_an_incomplete_folder_is_replaced(tmp_path):
    location = tmp_path / "store"
    location.mkdir()
    (location / "rows.bin").write_text("a writer that died before its manifest")
    write_folder(location, _writer("whole"), last=MANIFEST)
    assert sorted(p.name for p in location.iterdir()) == [MANIFEST, "rows.bin"]
    assert (location / "rows.bin").read_text() == "whole"


def test_a_folder_without_a_last_file_is_replaced_by_the_new_one(tmp_path):
    location = tmp_path / "report"
    location.mkdir()
    (location / "old.png").write_text("old")
    write_folder(location, lambda folder: (folder / "new.png").write_text("new"))
    assert [p.name for p in location.iterdir()] == ["new.png"]
