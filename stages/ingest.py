"""Stage ingest: data.source (synthetic generator or a folder of class subfolders) -> data/raw."""

from pathlib import Path

from pipeline.data.ingest import ingest
from pipeline.entry import run_stage


def main(params):
    ingest(params.data, Path("data/raw"))


if __name__ == "__main__":
    run_stage("ingest", main)
