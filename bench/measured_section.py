"""The measured section of a docs/ page: the text between a benchmark script's MEASURED markers,
which the script rewrites while the rest of the page (written by hand) stays as it is."""

from pathlib import Path

END = "<!-- END MEASURED -->"


def begin(script):
    return "<!-- MEASURED: written by bench/%s -->" % script


def write(path, script, body, create=False):
    """Replaces the section of bench/<script> in the page at path by body (the text between the
    markers). create: a page that does not exist yet becomes the section alone; otherwise a
    missing page, or one without the markers, is an error."""
    path, start = Path(path), begin(script)
    text = path.read_text() if path.exists() or not create else "%s\n%s\n" % (start, END)
    if start not in text or END not in text:
        raise SystemExit("%s lacks the markers %s ... %s" % (path, start, END))
    head, rest = text.split(start, 1)
    path.write_text(head + start + "\n" + body + "\n" + END + rest.split(END, 1)[1])
