"""``datasets.locations.write_folder`` on local disk: a folder appears whole or not at all, and a
complete folder that a concurrent writer put there first is left to the runs reading it (two
trials of a sweep building one content-keyed validation store found its files deleted under
them when the second writer replaced it), and a folder of someone else's files in the way is
never deleted (``partition --out`` a user's folder deleted it)."""

from pathlib import Path

import pytest

from datasets.locations import FolderInTheWay, write_folder

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


def test_an_earlier_copy_without_its_last_file_is_replaced(tmp_path):
    location = tmp_path / "store"
    location.mkdir()
    (location / "rows.bin").write_text("a copy that lost its manifest")
    write_folder(location, _writer("whole"), last=MANIFEST)
    assert sorted(p.name for p in location.iterdir()) == [MANIFEST, "rows.bin"]
    assert (location / "rows.bin").read_text() == "whole"
    report = tmp_path / "report"
    report.mkdir()
    (report / "plot.png").write_text("old")
    write_folder(report, lambda folder: (folder / "plot.png").write_text("new"))
    assert (report / "plot.png").read_text() == "new"


@pytest.mark.parametrize("last", [MANIFEST, None])
def test_a_folder_holding_other_files_is_never_deleted(tmp_path, last):
    location = tmp_path / "mine"
    (location / "notes").mkdir(parents=True)
    (location / "thesis.txt").write_text("years of work")
    (location / "rows.bin").write_text("a name the store also writes")
    with pytest.raises(FolderInTheWay, match=r"holds other files \(notes, thesis.txt\)"):
        write_folder(location, _writer("store"), last=last)
    assert sorted(p.name for p in location.iterdir()) == ["notes", "rows.bin", "thesis.txt"]
    assert (location / "thesis.txt").read_text() == "years of work"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # no staging folder left
