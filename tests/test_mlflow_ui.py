"""The MLflow UI in a real headless browser, over the store two `dvc exp run` experiments wrote.

A tiny committed project (an ensemble of two networks, so each model's run has runs nested under it)
runs the whole pipeline twice with `dvc exp run`: `ui-base`, and `ui-lr-low` with another train.lr.
`mlflow server` serves its SQLite store; Chromium (Debian's package, driven by Playwright) opens the
runs table, a model's run, the two experiments side by side and the registered version, the way a person
would. The checks read the pages' text (the DOM), not pixels. Screenshots land in the session's pytest
temporary folder (their paths are printed; on a failure, the page's text beside them).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.browser import browser_missing, chromium, mlflow_server
from tests.conftest import copy_project, tiny_params, venv_env

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


EXPERIMENTS = {"ui-base": [], "ui-lr-low": ["-S", "train.lr=0.001"]}  # dvc exp run's name and changes


@dataclass
class Ui:
    base: str
    project: Path
    shots: Path  # screenshots and failure dumps
    experiment_id: str
    run_id: str  # the model's run of the last experiment (models/train/run.json)
    run_name: str
    artifacts: Path  # the run's artifact folder, as the store records it
    other: dict  # the first experiment's model run: {"run_id", "run_name"}
    children: dict[str, str]  # the run's nested runs: {run name: run id}
    version: str  # the registered version made from the run
    metrics: dict[str, float] = field(default_factory=dict)

    def url(self, route: str) -> str:
        sep = "&" if "?" in route else "?"
        return f"{self.base}/#/experiments/{self.experiment_id}{route}{sep}{ML_VIEW}"


@pytest.fixture(scope="module")
def experiments(tmp_path_factory) -> Path:
    """A committed tiny project (an ensemble of 2) whose pipeline ran as two DVC experiments."""
    project = copy_project(tmp_path_factory.mktemp("ui-project"))
    p = tiny_params(**{"model.name": "test_efficientnet"})
    p["train"].update(ensemble=2, epochs=2)
    (project / "params.yaml").write_text(json.dumps(p))  # JSON is YAML
    who = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "add", "-A"], ["git", "commit", "-qm", "project"]):
        subprocess.run(cmd, cwd=project, check=True, env=venv_env() | who)
    for name, changes in EXPERIMENTS.items():
        cmd = [sys.executable, "-m", "dvc", "exp", "run", "-n", name, *changes]
        proc = subprocess.run(cmd, cwd=project, env=venv_env(), capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"dvc exp run {name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return project


@pytest.fixture(scope="module")
def ui(experiments: Path, tmp_path_factory) -> Ui:
    from mlflow import MlflowClient

    project, shots = experiments, tmp_path_factory.mktemp("mlflow-ui")
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.get_experiment_by_name(yaml.safe_load((project / "params.yaml").read_text())["mlflow"]["experiment"])
    assert exp is not None, f"no experiment in {project / 'mlflow.db'}"
    assert exp.artifact_location == (project / "mlartifacts").as_uri(), exp.artifact_location
    run = client.get_run(json.loads((project / "models/train/run.json").read_text())["run_id"])
    artifacts = Path(urllib.parse.urlparse(run.info.artifact_uri).path)
    assert artifacts.is_relative_to(project / "mlartifacts") and artifacts.is_dir(), run.info.artifact_uri
    runs = client.search_runs([exp.experiment_id])
    models = {r.info.run_name.split("-2x")[0]: r for r in runs if "mlflow.parentRunId" not in r.data.tags}
    assert sorted(models) == sorted(EXPERIMENTS), [r.info.run_name for r in runs]
    children = {
        r.info.run_name: r.info.run_id for r in runs if r.data.tags.get("mlflow.parentRunId") == run.info.run_id
    }
    (version,) = client.search_model_versions(f"run_id='{run.info.run_id}'")
    other = {"run_id": models["ui-base"].info.run_id, "run_name": models["ui-base"].info.run_name}

    log = shots / "mlflow-server.log"
    with mlflow_server(project, log) as base:
        print(f"mlflow server: {base} (log: {log})")
        # The server itself resolves the run's artifacts (a clearer failure than an empty tree in the UI).
        with urllib.request.urlopen(f"{base}/ajax-api/2.0/mlflow/artifacts/list?run_uuid={run.info.run_id}") as r:
            listed = {f["path"] for f in json.load(r).get("files", [])}
        assert {"evaluate", "train"} <= listed, f"server lists artifacts {sorted(listed)}"
        yield Ui(
            base,
            project,
            shots,
            exp.experiment_id,
            run.info.run_id,
            run.info.run_name,
            artifacts,
            other,
            children,
            str(version.version),
            dict(run.data.metrics),
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


def snapshot(page, shots: Path, name: str) -> Path:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path


@contextlib.contextmanager
def on_failure(page, shots: Path, name: str):
    """Leave a screenshot and the page text behind when a check inside fails."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            print(f"screenshot: {snapshot(page, shots, f'{name}-FAILED')}")
        with contextlib.suppress(Exception):
            (shots / f"{name}-FAILED.txt").write_text(f"url: {page.url}\n\n{page.inner_text('body')}")
            print(f"page text: {shots / f'{name}-FAILED.txt'}")
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
    with on_failure(page, ui.shots, "01-runs-table"):
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
        shots.append(snapshot(page, ui.shots, "01-runs-table"))

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
        shots.append(snapshot(page, ui.shots, "02-run-overview"))
        assert ui.run_id in page.url
    report(capsys, shots)


def test_run_artifacts_list_the_plots_and_preview_them(ui: Ui, page, capsys):
    from playwright.sync_api import expect

    shots = []

    def node(name: str):
        return page.locator(f'[data-testid="artifact-tree-node"][artifact-name="{name}"]')

    with on_failure(page, ui.shots, "03-artifacts"):
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
            shots.append(snapshot(page, ui.shots, f"0{i}-artifact-{folder}-{name.removesuffix('.png')}"))
            node(folder).click()  # fold it again, the next folder's files then sit where expected
    report(capsys, shots)


HEADLINE = ("test_accuracy", "test_defect_recall", "test_false_alarm_rate", "test_roc_auc", "test_threshold")


def run_row(page, run_id: str):
    return page.locator(f'.ag-row[row-id="{run_id}"]')  # one element per pinned / scrolled part of the row


def name_cell(page, run_id: str):
    return run_row(page, run_id).locator('.ag-cell[col-id="attributes.`Run Name`"]')


def test_the_runs_table_nests_each_network_under_its_model(ui: Ui, page, capsys):
    """Each experiment is one row (its model's run); the members' runs open under it, not beside it."""
    from playwright.sync_api import expect

    with on_failure(page, ui.shots, "07-nested-runs"):
        page.goto(ui.url("/runs"))
        parent = name_cell(page, ui.run_id)
        expect(parent).to_contain_text(ui.run_name, timeout=120_000)
        expect(name_cell(page, ui.other["run_id"])).to_contain_text(ui.other["run_name"])
        close_assistant(page)
        assert sorted(ui.children) == ["member-0", "member-1"]
        for child in ui.children.values():
            expect(run_row(page, child)).to_have_count(0)  # folded under the model's run
        parent.get_by_role("button").first.click()  # the expander beside the name
        for name, child in ui.children.items():
            expect(name_cell(page, child)).to_contain_text(name)

        def index(run_id: str) -> int:
            return int(run_row(page, run_id).first.get_attribute("row-index"))

        for child in ui.children.values():  # right under their model, before the other experiment's
            assert index(ui.run_id) < index(child) < index(ui.other["run_id"])
        shot = snapshot(page, ui.shots, "07-nested-runs")
    report(capsys, [shot])


def test_a_models_run_shows_its_test_figures_curves_and_nested_runs(ui: Ui, page, capsys):
    from playwright.sync_api import expect

    shots = []
    with on_failure(page, ui.shots, "08-model-run"):
        page.goto(ui.url(f"/runs/{ui.run_id}"))
        expect(page.get_by_role("tab", name="Overview")).to_have_attribute("aria-selected", "true", timeout=120_000)
        close_assistant(page)
        body = page.locator("body")
        # The description (evaluate's headline figures, promote's outcome) is what the page opens on.
        evaluated = json.loads((ui.project / "reports/evaluate/metrics.json").read_text())
        expect(body).to_contain_text(
            f"Test split, {evaluated['test_images']} images: accuracy {evaluated['accuracy']:.3f}"
        )
        expect(body).to_contain_text(f"Registry: version {ui.version} of defect-detection")
        expect(body).to_contain_text("Child runs")
        for name in ui.children:
            expect(page.get_by_role("link", name=name, exact=True)).to_be_visible()
        search = page.get_by_placeholder("Search metrics")
        for metric in HEADLINE:
            search.fill(metric)
            metric_row = page.get_by_role("row").filter(has=page.get_by_role("cell", name=metric, exact=True))
            value = metric_row.get_by_role("cell").nth(1)
            expect(value).to_have_text(re.compile(r"[0-9]"))
            assert shown_as(value.inner_text(), ui.metrics[metric]), f"{metric}: {value.inner_text()!r}"
        search.fill("")
        shots.append(snapshot(page, ui.shots, "08-model-run-overview"))

        # The curves: the first member's val_loss by epoch is a line over steps on the model's run.
        page.get_by_role("tab", name="Model metrics").click()
        page.get_by_placeholder("Search metric charts").fill("val_loss")
        card = page.get_by_test_id("experiment-view-compare-runs-card").filter(
            has=page.get_by_text("val_loss", exact=True)
        )
        expect(card).to_have_count(1)
        expect(card).to_contain_text("Step")
        expect(card.locator(".scatterlayer .trace")).not_to_have_count(0)
        shots.append(snapshot(page, ui.shots, "09-model-run-curves"))
    report(capsys, shots)


def test_two_dvc_experiments_side_by_side(ui: Ui, page, capsys):
    """Tick both experiments' runs, Compare: the one param that differs, and their test figures."""
    from playwright.sync_api import expect

    shots = []
    with on_failure(page, ui.shots, "10-compare"):
        page.goto(ui.url("/runs"))
        for run_id in (ui.run_id, ui.other["run_id"]):
            name_cell(page, run_id).wait_for(timeout=120_000)
            run_row(page, run_id).locator(".ag-selection-checkbox input").first.click()
        close_assistant(page)
        page.get_by_role("button", name="Compare", exact=True).click()
        expect(page).to_have_url(re.compile("compare-runs"))
        body = page.locator("body")
        expect(body).to_contain_text("Comparing 2 Runs")
        for name in (ui.run_name, ui.other["run_name"]):
            expect(body).to_contain_text(name)
        diff_only = page.get_by_role("switch", name="Parameters - Show diff only")
        diff_only.click()
        params = diff_only.locator("xpath=ancestor::*[contains(@class,'collapse-item')][1]")
        differing = params.get_by_role("row")  # with "Show diff only": the params that differ, one row each
        expect(differing).to_have_count(1)
        expect(differing.get_by_role("rowheader")).to_have_text("train.lr")
        expect(differing.get_by_role("cell")).to_have_text(["0.001", "0.003"])  # the runs in the order ticked
        shots.append(snapshot(page, ui.shots, "10-compare-params"))

        # Metrics: names and values are two virtual grids side by side; the values' grid scrolls (a wheel over
        # it, as a person would) and the names follow one scroll event behind, hence the last small nudge.
        names, values = (page.locator(".ReactVirtualized__Grid").nth(i).element_handle() for i in range(2))
        values.scroll_into_view_if_needed()
        box = values.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        metric = page.get_by_text("test_accuracy", exact=True)
        for _ in range(60):
            if metric.count():
                break
            page.mouse.wheel(0, 150)
            page.wait_for_timeout(150)
        row_top = metric.locator("xpath=ancestor::div[contains(@style,'top')][1]").get_attribute("style")
        top = re.search(r"top: ([0-9.]+)px", row_top)[1]
        while values.evaluate("g => g.scrollTop") < float(top) - 100:  # its row near the top of the view
            page.mouse.wheel(0, 40)
            page.wait_for_timeout(150)
        page.mouse.wheel(0, 10)
        page.wait_for_timeout(500)
        shown = [e.inner_text() for e in values.query_selector_all(f"xpath=./div/div[contains(@style,'top: {top}px')]")]
        from mlflow import MlflowClient

        other = MlflowClient(f"sqlite:///{ui.project / 'mlflow.db'}").get_run(ui.other["run_id"])
        expected = [ui.metrics["test_accuracy"], other.data.metrics["test_accuracy"]]
        assert len(shown) == 2 and all(shown_as(t, v) for t, v in zip(shown, expected, strict=True)), shown
        shots.append(snapshot(page, ui.shots, "11-compare-metrics"))
    report(capsys, shots)


def test_the_registered_version_says_what_it_is_and_why(ui: Ui, page, capsys):
    from mlflow import MlflowClient
    from playwright.sync_api import expect

    uri = f"sqlite:///{ui.project / 'mlflow.db'}"
    version = MlflowClient(uri, uri).get_model_version("defect-detection", ui.version)
    decision = json.loads((ui.project / "reports/promote/decision.json").read_text())
    with on_failure(page, ui.shots, "12-model-version"):
        page.goto(f"{ui.base}/#/models/defect-detection/versions/{ui.version}")
        body = page.locator("body")
        expect(body).to_contain_text(f"Version {ui.version}", timeout=120_000)
        close_assistant(page)
        first, *_ = version.description.split("\n")
        expect(body).to_contain_text(first)  # what it is: network, variant, size, classes, threshold
        expect(body).to_contain_text(f"{decision['reason']}.")  # why it is, or is not, the champion
        expect(body).to_contain_text(ui.run_name)  # its source run
        for tag in ("classes", "ok_class", "variant", "threshold", "data_fingerprint", *HEADLINE[:4]):
            row = page.get_by_role("row").filter(has=page.get_by_role("cell", name=tag, exact=True))
            expect(row).to_contain_text(version.tags[tag])
        shot = snapshot(page, ui.shots, "12-model-version")
    report(capsys, [shot])
