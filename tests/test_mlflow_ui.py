"""The MLflow UI in a real headless browser, over the store a tiny pipeline run wrote.

`mlflow server` serves the `exported_project` fixture's SQLite store; Chromium (Debian's package,
driven by Playwright) opens the experiment's runs table and the run's pages the way a person would.
Screenshots land in test-artifacts/mlflow-ui/ (their paths are printed; `pytest -s` shows them).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.browser import SHOTS, browser_missing, chromium, dump_failure, mlflow_server, snapshot

pytestmark = [  # a browser against a live MLflow server: left out of `make test-fast`
    pytest.mark.slow,
    pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or ""),
]

# MLflow 3.17 opens an experiment in its GenAI views (usage overview, traces) whatever the experiment's
# `mlflow.experimentKind` tag says: the sidebar's "GenAI | Model training" switch (remembered in the
# browser's localStorage) or this URL parameter picks the view.
ML_VIEW = "workflowType=machine_learning"
TABLE_METRICS = ("test_accuracy", "val_loss")  # one from evaluate, one from train: both stages logged here
PLOTS = ("evaluate/confusion_matrix.png", "train/loss.png")


@dataclass
class Ui:
    base: str
    project: Path
    experiment_id: str
    run_id: str
    run_name: str
    artifacts: Path  # the run's artifact folder, as the store records it
    metrics: dict[str, float] = field(default_factory=dict)

    def url(self, route: str) -> str:
        sep = "&" if "?" in route else "?"
        return f"{self.base}/#/experiments/{self.experiment_id}{route}{sep}{ML_VIEW}"


@pytest.fixture(scope="module")
def ui(exported_project: Path) -> Ui:
    from mlflow import MlflowClient

    project = exported_project
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    cfg = yaml.safe_load((project / "params.yaml").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name(cfg["experiment"])
    assert exp is not None, f"experiment {cfg['experiment']!r} not in {project / 'mlflow.db'}"
    assert exp.artifact_location == (project / "mlartifacts").as_uri(), exp.artifact_location
    run = client.get_run(json.loads((project / "models/train/run.json").read_text())["run_id"])
    artifacts = Path(urllib.parse.urlparse(run.info.artifact_uri).path)
    assert artifacts.is_relative_to(project / "mlartifacts") and artifacts.is_dir(), run.info.artifact_uri

    log = SHOTS / "mlflow-server.log"
    with mlflow_server(project, log) as base:
        print(f"mlflow server: {base} (log: {log})")
        # The server itself resolves the run's artifacts (a clearer failure than an empty tree in the UI).
        with urllib.request.urlopen(f"{base}/ajax-api/2.0/mlflow/artifacts/list?run_uuid={run.info.run_id}") as r:
            listed = {f["path"] for f in json.load(r).get("files", [])}
        assert {"evaluate", "train"} <= listed, f"server lists artifacts {sorted(listed)}"
        yield Ui(
            base, project, exp.experiment_id, run.info.run_id, run.info.run_name, artifacts, dict(run.data.metrics)
        )


@pytest.fixture(scope="module")
def browser(ui):  # after `ui`: no browser is started when the server cannot come up
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser):
    from playwright.sync_api import expect

    expect.set_options(timeout=60_000)  # the SPA renders slowly on busy cores
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    context.set_default_timeout(60_000)
    context.set_default_navigation_timeout(120_000)
    page = context.new_page()
    page.on("pageerror", lambda e: print(f"page error: {e}"))
    yield page
    context.close()


@contextlib.contextmanager
def on_failure(page, name: str):
    """Leave a screenshot and the page text behind when a check inside fails."""
    try:
        yield
    except BaseException:
        dump_failure(page, name)
        raise


def close_assistant(page) -> None:
    """Fold away the MLflow Assistant panel that opens on a first visit (it takes a third of the width)."""
    close = page.get_by_role("button", name="Close", exact=True)
    with contextlib.suppress(Exception):
        if close.count() == 1 and close.is_visible():
            close.click(timeout=5_000)


def shown_as(text: str, value: float) -> bool:
    """Whether the table's text is ``value`` as displayed, at whatever precision the UI chose."""
    text = text.strip()
    shown = float(text)
    mantissa = text.lower().split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    scale = 10 ** int(text.lower().split("e")[1]) if "e" in text.lower() else 1
    return abs(shown - value) <= 0.5 * 10**-decimals * scale + 1e-12 * abs(value)


def show_metric_column(page, metric: str) -> None:
    """Runs table: tick ``metric`` in the Columns menu (MLflow 3 shows no metric column by default)."""
    page.get_by_role("button", name="Columns").click()
    search = page.get_by_placeholder("Search columns")
    search.fill(metric)
    node = page.locator("[class*='tree-treenode']").filter(has_text=metric).last
    node.locator("[class*='tree-checkbox']").first.click()
    page.keyboard.press("Escape")
    search.wait_for(state="hidden")


def report(capsys, shots: list[Path]) -> None:
    with capsys.disabled():  # shown even without -s: where to look
        for shot in shots:
            print(f"\nscreenshot: {shot}", end="")
        print()


def test_runs_table_lists_the_run_with_its_metrics(ui: Ui, page, capsys):
    from playwright.sync_api import expect

    shots = []
    with on_failure(page, "01-runs-table"):
        # As a person would: open the experiment, then flip the sidebar switch to "Model training"
        # (a fresh browser lands on the GenAI overview); the choice then sticks for later pages.
        page.goto(f"{ui.base}/#/experiments/{ui.experiment_id}")
        page.get_by_role("button", name="Model training", exact=True).click(timeout=120_000)
        expect(page).to_have_url(re.compile(ML_VIEW))
        row = page.locator(f'.ag-row[row-id="{ui.run_id}"]')
        name_cell = row.locator('.ag-cell[col-id="attributes.`Run Name`"]')
        expect(name_cell).to_contain_text(ui.run_name, timeout=120_000)  # first load: the SPA bundle is big
        close_assistant(page)
        for metric in TABLE_METRICS:
            show_metric_column(page, metric)
            header = page.locator(f'.ag-header-cell[col-id="metrics.`{metric}`"]')
            expect(header).to_contain_text(metric)
            cell = row.locator(f'.ag-cell[col-id="metrics.`{metric}`"]')
            expect(cell).to_have_text(re.compile(r"[0-9]"))
            text = cell.inner_text()
            assert shown_as(text, ui.metrics[metric]), f"{metric}: table shows {text!r}, run has {ui.metrics[metric]}"
            cell.scroll_into_view_if_needed()
        shots.append(snapshot(page, "01-runs-table"))

        # The run name links to the run's page, whose overview lists the metrics with their values.
        name_cell.get_by_role("link", name=ui.run_name).click()
        expect(page.get_by_role("tab", name="Overview")).to_have_attribute("aria-selected", "true")
        expect(page.get_by_role("heading", name=ui.run_name, exact=True)).to_be_visible()
        page.get_by_placeholder("Search metrics").fill("test_accuracy")
        metric_row = page.get_by_role("row").filter(has=page.get_by_role("cell", name="test_accuracy", exact=True))
        value_cell = metric_row.get_by_role("cell").nth(1)
        expect(value_cell).to_have_text(re.compile(r"[0-9]"))
        text = value_cell.inner_text()
        assert shown_as(text, ui.metrics["test_accuracy"]), f"overview shows test_accuracy {text!r}"
        shots.append(snapshot(page, "02-run-overview"))
        assert ui.run_id in page.url
    report(capsys, shots)


def test_run_artifacts_list_the_plots_and_preview_them(ui: Ui, page, capsys):
    from playwright.sync_api import expect

    shots = []

    def node(name: str):
        return page.locator(f'[data-testid="artifact-tree-node"][artifact-name="{name}"]')

    with on_failure(page, "03-artifacts"):
        page.goto(ui.url(f"/runs/{ui.run_id}"))
        page.get_by_role("tab", name="Artifacts").click(timeout=120_000)
        close_assistant(page)
        for folder in ("validate", "augment", "train", "evaluate", "export"):
            expect(node(folder)).to_be_visible()
        for i, plot in enumerate(PLOTS, start=3):
            folder, name = plot.split("/")
            node(folder).click()
            node(name).click()
            image = page.locator(f'img[alt="{plot}"]')
            expect(image).to_be_visible()
            page.wait_for_function(
                "img => img.complete && img.naturalWidth > 0", arg=image.element_handle(), timeout=60_000
            )
            on_disk = ui.artifacts / plot
            with Image.open(on_disk) as png:
                assert image.evaluate("img => img.naturalWidth") == png.width, f"preview of {plot} is another image"
            # The preview names the file under the project's artifact folder: the store resolved there.
            expect(page.locator("body")).to_contain_text(on_disk.as_uri())
            shots.append(snapshot(page, f"0{i}-artifact-{folder}-{name.removesuffix('.png')}"))
            node(folder).click()  # fold it again, the next folder's files then sit where expected
    report(capsys, shots)
