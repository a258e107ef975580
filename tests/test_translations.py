"""The Chinese edition (notebooks/zh/) is kept in step with the English notebooks, its source.

- every markdown cell of every English notebook has a translation of its text as it is today;
- the committed Chinese notebooks are what `scripts/zh_catalogs.py build` makes (no hand edits);
- their code cells, outputs, tags and metadata are the English ones (strict nbval of the English covers them);
- each glossary term an English cell uses appears in its translation (the glossary's Chinese, or the English);
- their relative links resolve from notebooks/zh/.
"""
import os
import re
import sys
from pathlib import Path

import nbformat
import polib
import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import zh_catalogs  # noqa: E402

ENGLISH = zh_catalogs.english_notebooks()
NAMES = [p.name for p in ENGLISH]
ZH = Path(REPO) / "notebooks" / "zh"
GLOSSARY = Path(REPO) / "notebooks" / "glossary.md"


def _english(name):
    return Path(REPO) / "notebooks" / name


# ---- every cell translated, and stale when its English changes ------------------------------------

def test_every_markdown_cell_has_a_current_translation():
    found = [problem for notebook in ENGLISH for problem in zh_catalogs.problems(notebook)]
    print("\n".join(found))
    assert not found, f"{len(found)} markdown cells without a current translation, e.g.:\n" + "\n".join(found[:20])


def test_a_changed_english_cell_makes_its_entry_stale_and_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(zh_catalogs, "PO", tmp_path / "po")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"), nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_markdown_cell("A **process group** joins ranks.")]
    book = tmp_path / "99_sample.ipynb"
    nbformat.write(nb, str(book))
    assert zh_catalogs.extract(book) == (0, 0, 2)
    assert len(zh_catalogs.problems(book)) == 2                     # nothing translated yet
    po = polib.pofile(str(zh_catalogs.catalog_path(book)), wrapwidth=0)
    for entry, text in zip(po, ["# 标题", "**进程组**把各个 rank 连在一起。"]):
        entry.msgstr = text
    po.save()
    assert zh_catalogs.problems(book) == []
    nb.cells[2].source = "A **process group** joins some ranks."   # the English changes
    nbformat.write(nb, str(book))
    found = zh_catalogs.problems(book)
    assert len(found) == 1 and "99_sample.ipynb cell 2" in found[0] and nb.cells[2].id in found[0], found
    assert "changed" in found[0]
    assert zh_catalogs.extract(book) == (1, 1, 0)                    # kept fuzzy, with the old English
    stale = polib.pofile(str(zh_catalogs.catalog_path(book)), wrapwidth=0)[1]
    assert "fuzzy" in stale.flags and stale.previous_msgid == "A **process group** joins ranks."


# ---- the committed Chinese notebooks are the build's -------------------------------------------------

def _complete(name):
    return not zh_catalogs.problems(_english(name))


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_chinese_notebook_is_what_build_makes(name):
    if not _complete(name):
        assert not (ZH / name).exists(), f"notebooks/zh/{name} is committed, but its catalog is incomplete"
        pytest.skip(f"{name}: its catalog is not complete yet")
    assert (ZH / name).exists(), f"notebooks/zh/{name} is missing: run scripts/zh_catalogs.py build"
    made = nbformat.writes(zh_catalogs.translated(_english(name))) + "\n"
    committed = (ZH / name).read_text(encoding="utf-8")
    assert committed == made, f"notebooks/zh/{name} is not what the build makes: run scripts/zh_catalogs.py build"


def test_every_chinese_notebook_has_its_english_source():
    extra = sorted(p.name for p in ZH.glob("*.ipynb") if p.name not in NAMES)
    assert not extra, f"Chinese notebooks without an English one: {extra}"


# ---- code, outputs, tags and metadata are the English ones -------------------------------------------

def _code_and_metadata_differences(english, chinese):
    """What differs between two editions of a notebook, other than the markdown cells' text."""
    found = []
    if english.metadata != chinese.metadata or english.nbformat_minor != chinese.nbformat_minor:
        found.append("the notebook's metadata")
    if [c.id for c in english.cells] != [c.id for c in chinese.cells]:
        return found + ["the cells (their ids, in order)"]
    for index, (en, zh) in enumerate(zip(english.cells, chinese.cells)):
        if en.cell_type != zh.cell_type:
            found.append(f"cell {index} ({en.id}): its type")
        elif en.cell_type == "markdown":
            if {k: v for k, v in en.items() if k != "source"} != {k: v for k, v in zh.items() if k != "source"}:
                found.append(f"cell {index} ({en.id}): its metadata (tags) or attachments")
        elif en != zh:
            found.append(f"cell {index} ({en.id}): its code, outputs, tags or metadata")
    return found


def _identity(notebook):
    """Every markdown cell 'translated' into its own English text: the build's other work, seen on its own."""
    nb = nbformat.read(notebook, as_version=4)
    return {c.id: c.source for c in nb.cells if c.cell_type == "markdown"}


@pytest.mark.parametrize("name", NAMES)
def test_the_build_keeps_code_outputs_tags_and_metadata(name):
    english = nbformat.read(_english(name), as_version=4)
    made = zh_catalogs.translated(_english(name), _identity(_english(name)))
    assert _code_and_metadata_differences(english, made) == []


@pytest.mark.parametrize("name", NAMES)
def test_the_chinese_code_cells_outputs_tags_and_metadata_are_the_english_ones(name):
    if not (ZH / name).exists():
        pytest.skip(f"notebooks/zh/{name} is not built yet")
    english = nbformat.read(_english(name), as_version=4)
    chinese = nbformat.read(ZH / name, as_version=4)
    found = _code_and_metadata_differences(english, chinese)
    assert not found, f"notebooks/zh/{name} differs from the English in: " + "; ".join(found)


def test_a_changed_output_is_found():
    english = nbformat.read(_english("06_ddp_cifar10.ipynb"), as_version=4)
    chinese = nbformat.read(_english("06_ddp_cifar10.ipynb"), as_version=4)
    code = next(i for i, c in enumerate(chinese.cells) if c.cell_type == "code" and c.outputs)
    chinese.cells[code].outputs[0]["text"] = "something else\n"
    tagged = next(i for i, c in enumerate(chinese.cells) if c.cell_type == "markdown")
    chinese.cells[tagged].metadata["tags"] = ["hide-input"]
    found = _code_and_metadata_differences(english, chinese)
    assert [f.split(":")[0] for f in found] == [f"cell {tagged} ({chinese.cells[tagged].id})",
                                                f"cell {code} ({chinese.cells[code].id})"], found


# ---- glossary terms -------------------------------------------------------------------------------------

# Terms also common English words that need no glossary term in their sense here ("reduce the memory",
# "store the state", "combine the results"): their rows' other spellings are still checked.
COMMON_WORDS = {"process", "reduce", "store", "expert", "capacity", "gradient", "combine"}


def _alternatives(chinese):
    """The glossary's 中文 cell as the spellings it accepts: `全规约（全归约，AllReduce）` ->
    全规约, 全归约, AllReduce; `rank（常不译；进程编号）` -> rank, 进程编号."""
    parts = re.split(r"[（）()；;、，,/]", chinese)
    return [p.strip() for p in parts if p.strip() and p.strip() != "常不译"]


def glossary_rows(text=None):
    """(English terms, Chinese spellings) of every glossary row whose term the glossary translates."""
    text = GLOSSARY.read_text(encoding="utf-8") if text is None else text
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or cells[0] in ("English", "---"):
            continue
        english, chinese = cells[0], cells[1]
        main = re.split(r"[（(]", chinese)[0].strip()
        if "常不译" in chinese or re.fullmatch(r"[\x00-\x7f]+", main):
            continue                              # the glossary keeps the English word
        terms = []
        for term in re.split(r" / |, ", re.sub(r"\s*\(.*?\)", "", english)):
            term = term.strip()
            if term and "`" not in term and term.lower() not in COMMON_WORDS:
                terms.append(term)
        if terms:
            rows.append((terms, _alternatives(chinese)))
    return rows


def _prose(markdown):
    """An English cell without its code, URLs and HTML: the words a translator translates."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"<[^>]+>", " ", text)


def _squeeze(text):
    return re.sub(r"\s+", "", text).lower()


def glossary_misses(english, chinese, rows):
    """The terms an English text uses whose translation has none of the glossary's spellings."""
    prose, translation = _prose(english), _squeeze(chinese)
    misses = []
    for terms, spellings in rows:
        for term in terms:
            if re.search(r"(?<![\w-])" + re.escape(term) + r"(?:s|es)?(?![\w-])", prose, re.I):
                if not any(_squeeze(s) in translation for s in spellings + [term]):
                    misses.append(f"{term!r} -> {' / '.join(spellings)}")
                break
    return misses


def _current_translations(notebook):
    """(cell index, id, English, Chinese) of every markdown cell whose translation is current."""
    path = zh_catalogs.catalog_path(notebook)
    if not path.exists():
        return []
    entries = {e.msgctxt: e for e in polib.pofile(str(path), wrapwidth=0)}
    nb = nbformat.read(notebook, as_version=4)
    out = []
    for index, cell in enumerate(nb.cells):
        entry = entries.get(cell.id)
        if cell.cell_type == "markdown" and entry and entry.msgstr and "fuzzy" not in entry.flags \
                and entry.msgid == cell.source:
            out.append((index, cell.id, cell.source, entry.msgstr))
    return out


def test_the_glossary_is_read_as_it_is_written():
    rows = glossary_rows()
    by_term = {term: spellings for terms, spellings in rows for term in terms}
    assert len(rows) > 60
    assert {"全规约", "全归约", "AllReduce"} <= set(by_term["all-reduce"])
    assert by_term["subgroup"] == ["子进程组", "子通信组"]
    assert by_term["global batch"] == by_term["per-rank batch"] == ["全局批大小", "每卡批大小"]
    assert "rank" not in by_term and "backend" not in by_term and "PowerSGD" not in by_term   # kept in English
    assert "stage" not in by_term and "process" not in by_term


def test_a_missing_glossary_term_is_found():
    rows = glossary_rows()
    english = "Each rank joins the **process group**, then an all-reduce sums the `barrier` tensors."
    assert glossary_misses(english, "每个 rank 加入进程组，然后全规约求和。", rows) == []
    assert glossary_misses(english, "每个 rank 加入进程组，然后 all-reduce 求和。", rows) == []   # English kept
    assert glossary_misses(english, "每个 rank 加入进程组，然后全归约求和。", rows) == []         # the alternative
    missed = glossary_misses(english, "每个 rank 加入组，然后求和。", rows)
    assert missed == ["'process group' -> 进程组", "'all-reduce' -> 全规约 / 全归约 / AllReduce"], missed


def test_each_glossary_term_an_english_cell_uses_is_in_its_translation():
    rows = glossary_rows()
    misses, checked = [], 0
    for notebook in ENGLISH:
        for index, cell_id, english, chinese in _current_translations(notebook):
            checked += 1
            for miss in glossary_misses(english, chinese, rows):
                misses.append(f"{notebook.name} cell {index} ({cell_id}): {miss}")
    print(f"{checked} translated cells checked")
    print("\n".join(misses))
    assert not misses, f"{len(misses)} glossary terms missing from translations:\n" + "\n".join(misses)


# ---- links ------------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(markdown, folder=ZH, course_ok=False):
    """Relative links of a notebooks/zh/ cell that lead nowhere (Chinese notebooks not yet built aside).
    course_ok: a link to a course notebook counts as working (it opens that notebook's Chinese edition)."""
    broken = []
    for target in LINK.findall(markdown):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z][a-z0-9+.-]*:", path) or path.startswith("/"):
            continue
        if (folder / path).exists():
            continue
        if path in NAMES and (course_ok or not _complete(path)):
            continue                              # its Chinese edition comes when its catalog is complete
        broken.append(target)
    return broken


def test_a_link_from_the_english_folder_is_fixed_by_the_build():
    text = ("See [the trainer](../ddp_helpers/train.py), [the glossary](glossary.md#training) "
            "and [01](01_process_groups.ipynb).")
    assert broken_links(text, course_ok=True) == ["../ddp_helpers/train.py", "glossary.md#training"]
    assert broken_links(zh_catalogs.relink(text), course_ok=True) == []


@pytest.mark.parametrize("name", NAMES)
def test_the_build_makes_every_link_work_from_the_chinese_folder(name):
    nb = zh_catalogs.translated(_english(name), _identity(_english(name)))
    found = [(i, t) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
             for t in broken_links(c.source, course_ok=True)]
    assert not found, f"{name}: links that lead nowhere from notebooks/zh/: {found}"


@pytest.mark.parametrize("name", NAMES)
def test_the_chinese_notebooks_links_resolve(name):
    if not (ZH / name).exists():
        pytest.skip(f"notebooks/zh/{name} is not built yet")
    nb = nbformat.read(ZH / name, as_version=4)
    found = [(i, t) for i, c in enumerate(nb.cells) if c.cell_type == "markdown" for t in broken_links(c.source)]
    assert not found, f"notebooks/zh/{name}: links that lead nowhere: {found}"


# ---- code cells work from notebooks/zh/ as from notebooks/ ---------------------------------------------

UP_A_FOLDER = re.compile(r"""["']\.\.[/\\"']|%%writefile\s+\.\.|^\s*%\w+.*\s\.\./""", re.M)


def _cells_up_a_folder(notebooks):
    return [f"{p.name} cell {i}" for p in notebooks for i, c in enumerate(nbformat.read(p, as_version=4).cells)
            if c.cell_type == "code" and UP_A_FOLDER.search(c.source)]


def test_no_code_cell_names_a_file_relative_to_the_notebooks_folder():
    """The Chinese notebooks' code is the English code, run from notebooks/zh/: a cell that names
    `../examples/...` would miss the file there. ddp_helpers.paths names the course's files instead."""
    found = _cells_up_a_folder(ENGLISH)
    assert not found, f"code cells that name a path from notebooks/ (use ddp_helpers.paths): {found}"


def test_the_examples_are_found_from_either_folder(monkeypatch):
    from ddp_helpers import paths
    for folder in (Path(REPO) / "notebooks", ZH):
        monkeypatch.chdir(folder)
        for name in ("ddp_minimal.py", "slurm_ddp.sbatch"):
            assert os.path.isfile(paths.example(name)) and not os.path.isabs(paths.example(name))
    monkeypatch.chdir(Path(REPO) / "notebooks")
    assert paths.example("ddp_minimal.py") == os.path.join("..", "examples", "ddp_minimal.py")   # as printed in 06


# ---- a re-measured Run All time keeps the Chinese first cell current ------------------------------------

def _stamped_sample(tmp_path, monkeypatch):
    """A notebook with a translated first cell that states its Run All time, and its Chinese edition."""
    import stamp_times
    monkeypatch.setattr(zh_catalogs, "PO", tmp_path / "zh" / "po")
    monkeypatch.setattr(zh_catalogs, "ZH", tmp_path / "zh")
    table = {"machine": {"short": "a 2-core CPU"}}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 99 · Sample\n\n**Time**: about 30 minutes.\n"
                                              + stamp_times.run_all_line(9.0, table)),
                nbformat.v4.new_code_cell("print(1)")]
    book = tmp_path / "99_sample.ipynb"
    nbformat.write(nb, str(book))
    zh_catalogs.extract(book)
    po = polib.pofile(str(zh_catalogs.catalog_path(book)), wrapwidth=0)
    po[0].msgstr = "# 99 · 示例\n\n**时间**：约 30 分钟。\n**Run All**：在 2 核 CPU 上约 10 秒，含重启内核。"
    po.save()
    zh_catalogs.build(book)
    return stamp_times, table, book


def test_a_new_run_all_time_is_written_into_the_translation_too(tmp_path, monkeypatch):
    stamp_times, table, book = _stamped_sample(tmp_path, monkeypatch)
    assert stamp_times.stamp_notebook(book, stamp_times.run_all_line(24.0, table))    # re-measured: 25 s
    assert zh_catalogs.problems(book) == []                                            # still current
    entry = polib.pofile(str(zh_catalogs.catalog_path(book)), wrapwidth=0)[0]
    assert entry.msgid.endswith("**Run All**: about 25 s on a 2-core CPU, kernel restart included.")
    assert entry.msgstr.splitlines()[-1] == "**Run All**：在 2 核 CPU 上约 25 秒，含重启内核。"
    assert entry.msgstr.splitlines()[2] == "**时间**：约 30 分钟。"
    chinese = nbformat.read(tmp_path / "zh" / book.name, as_version=4)                # built again
    assert chinese.cells[0].source == entry.msgstr and chinese.cells[1].source == "print(1)"


def test_a_change_beyond_the_numbers_leaves_the_translation_to_a_translator(tmp_path, monkeypatch):
    stamp_times, table, book = _stamped_sample(tmp_path, monkeypatch)
    before = nbformat.read(book, as_version=4).cells[0].source
    assert stamp_times.stamp_notebook(book, stamp_times.run_all_line(9.0, {"machine": {"short": "a laptop"}}))
    found = zh_catalogs.problems(book)
    assert len(found) == 1 and "changed" in found[0], found
    entry = polib.pofile(str(zh_catalogs.catalog_path(book)), wrapwidth=0)[0]
    assert "fuzzy" in entry.flags and entry.previous_msgid == before and "约 10 秒" in entry.msgstr


# ---- the Chinese README ----------------------------------------------------------------------------------

def test_the_chinese_readme_has_the_two_commands_the_map_and_the_links_both_ways():
    english = (Path(REPO) / "README.md").read_text(encoding="utf-8")
    chinese = (Path(REPO) / "README.zh.md").read_text(encoding="utf-8")
    commands = [line for line in english.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(commands) >= 2 and all(c in chinese.splitlines() for c in commands), \
        "README.zh.md lacks the English README's commands"
    assert "](README.zh.md)" in english.split("\n## ", 1)[0], "the English README links the Chinese one at its top"
    assert "](README.md)" in chinese.split("\n## ", 1)[0], "README.zh.md links the English README at its top"
    for name in NAMES:
        assert f"](notebooks/zh/{name})" in chinese, f"README.zh.md's map lacks notebooks/zh/{name}"
    broken = [t for t in LINK.findall(chinese) if not re.match(r"[a-z]+:|#", t)
              and not (Path(REPO) / t.split("#", 1)[0]).exists()]
    assert not broken, f"README.zh.md: links that lead nowhere: {broken}"
    assert "fonts-noto-cjk" in chinese and "fonts-noto-cjk" in english


# ---- the instructor's guide (notebooks/instructors.md) in Chinese ------------------------------------

GUIDE_ZH = ZH / "instructors.md"
TIMES = re.compile(r"<!-- run-all-times: begin.*?<!-- run-all-times: end -->", re.S)
SAMPLE_GUIDE = """# For instructors

Each notebook is one lesson.

| time | notebook |
| --- | --- |
| 10 min | [00](00_welcome.ipynb) |

<!-- run-all-times: begin (scripts/stamp_times.py writes this table) -->

| notebook | Run All |
| --- | --- |
| [00](00_welcome.ipynb) | 10 s |

<!-- run-all-times: end -->

Each notebook is one lesson.

- **A mistake.** Its cure.
"""


def test_every_block_of_the_guide_has_a_current_translation():
    found = zh_catalogs.guide_problems()
    assert not found, f"{len(found)} blocks of notebooks/instructors.md without a current translation:\n" + \
        "\n".join(found[:20])


def test_a_changed_block_of_the_guide_is_named_and_new_times_are_not(tmp_path):
    guide, po_path = tmp_path / "instructors.md", tmp_path / "instructors.po"
    guide.write_text(SAMPLE_GUIDE, encoding="utf-8")
    assert zh_catalogs.extract_guide(guide, po_path) == (0, 0, 5)   # 5 blocks; the times table is none
    po = polib.pofile(str(po_path), wrapwidth=0)
    assert [e.msgctxt for e in po] == [None, None, None, "2", None]  # identical blocks told apart
    assert all("run-all-times" not in e.msgid and "10 s" not in e.msgid for e in po)
    zh = ["# 讲师指南", "每个 notebook 是一节课。",
          "| 时长 | notebook |\n| --- | --- |\n| 10 min | [00](00_welcome.ipynb) |",
          "每个 notebook 都是一节课。", "- **一个错误。** 改正方法。"]
    for entry, text in zip(po, zh):
        entry.msgstr = text
    po.save()
    assert zh_catalogs.guide_problems(guide, po_path) == []
    built = zh_catalogs.translated_guide(guide, po_path)
    assert TIMES.search(built).group() == TIMES.search(SAMPLE_GUIDE).group() and "每个 notebook 都是一节课。" in built
    guide.write_text(SAMPLE_GUIDE.replace("| 10 s |", "| 25 s |"), encoding="utf-8")   # re-measured
    assert zh_catalogs.guide_problems(guide, po_path) == []
    assert "| 25 s |" in zh_catalogs.translated_guide(guide, po_path)
    guide.write_text(SAMPLE_GUIDE.replace("Its cure.", "Its cure, and why."), encoding="utf-8")
    found = zh_catalogs.guide_problems(guide, po_path)
    assert len(found) == 1 and "block 4" in found[0] and "A mistake" in found[0] and "changed" in found[0], found
    with pytest.raises(SystemExit, match="block 4"):
        zh_catalogs.build_guide(guide, po_path, tmp_path / "out.md")
    assert zh_catalogs.extract_guide(guide, po_path) == (4, 1, 0)   # kept fuzzy, with the old English
    entry = polib.pofile(str(po_path), wrapwidth=0)[4]
    assert "fuzzy" in entry.flags and entry.previous_msgid.endswith("Its cure.") and entry.msgstr == zh[4]
    assert len(zh_catalogs.guide_problems(guide, po_path)) == 1


def test_the_committed_chinese_guide_is_what_build_makes():
    assert GUIDE_ZH.exists(), "notebooks/zh/instructors.md is missing (run: scripts/zh_catalogs.py build instructors)"
    assert GUIDE_ZH.read_text(encoding="utf-8") == zh_catalogs.translated_guide(), \
        "notebooks/zh/instructors.md differs from what `scripts/zh_catalogs.py build instructors` makes"


def test_the_chinese_guides_times_table_is_the_english_one():
    english = TIMES.findall((Path(REPO) / "notebooks" / "instructors.md").read_text(encoding="utf-8"))
    chinese = TIMES.findall(GUIDE_ZH.read_text(encoding="utf-8"))
    assert len(english) == 1 and chinese == english, "the Chinese guide's Run All table is not the English one"


def test_the_chinese_guides_links_resolve():
    found = broken_links(GUIDE_ZH.read_text(encoding="utf-8"))
    assert not found, f"notebooks/zh/instructors.md: links that lead nowhere: {found}"


def test_the_chinese_readme_links_the_chinese_guide():
    chinese = (Path(REPO) / "README.zh.md").read_text(encoding="utf-8")
    assert "](notebooks/zh/instructors.md)" in chinese, "README.zh.md does not link notebooks/zh/instructors.md"
