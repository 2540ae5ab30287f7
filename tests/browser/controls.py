"""Use every ipywidgets control in a notebook's outputs, as a learner would, and say what each changed.

``Exerciser(page, lab, notebook).run()`` finds every control (lab_probe.js ``scan``), and from the state
Run All left, one control at a time: picks every other option of a dropdown or toggle-button row (three
spread ones past four), moves a slider to its far end, ticks a checkbox, clicks a button, types a valid
number into a text box; then puts the control back (a slider through its readout) and checks that too.
A control that was disabled at the start and becomes enabled while another one is changed is used in
that state. After every action it waits until the cell's outputs change, or until the kernel has
handled the change and been idle for ``GRACE_S`` with nothing changed (a dead control costs that, not a
long timeout). Each action leaves ``failures`` ((cell, line): nothing visible changed), ``problems`` (layout
problems lab_probe.js finds in the cell after it) and ``notes`` (controls that cannot be changed).
"""

from __future__ import annotations

import time

CHANGE_TIMEOUT_S = 120      # an action's change, or its kernel round trip, under a heavily loaded machine
NO_MESSAGE_S = 30           # no message reached the kernel in this long: the action sent nothing
GRACE_S = 4.0               # the kernel handled the change and is idle: the page has this long to show it
STABLE_S = 1.0              # outputs unchanged this long after a change: it is complete
MAX_OPTIONS = 4             # options tried per dropdown / toggle-button row (all when at most this many)


def spread(options: list, current) -> list:
    """The options to try: all others when at most MAX_OPTIONS, else the next, the middle and the last."""
    others = [o for o in options if o != current]
    if len(others) <= MAX_OPTIONS:
        return others
    picks = [others[0], others[len(others) // 2], others[-1]]
    return list(dict.fromkeys(picks))


def other_number(control: dict) -> str | None:
    """A valid value to type that differs from the box's: within min / max for a number box; None for
    free text (no valid value is known: the test says so rather than guess)."""
    value = control["value"]
    if control["type"] == "number":
        low, high = control["min"], control["max"]
        for candidate in (high, low):
            if candidate not in (None, "") and candidate != value:
                return candidate
        return str(float(value or 0) + 1)
    try:
        float(value)
    except ValueError:
        return None
    return "2.5" if value.strip() == "3.14159" else "3.14159"


def describe(control: dict) -> str:
    name = control["description"] or control["text"] or "(no label)"      # unlabelled options: "a | b"
    nth = f" #{control['ordinal'] + 1}" if control["ordinal"] else ""
    return f'cell {control["cell"]} {control["kind"]} "{name}"{nth}'


class Exerciser:
    def __init__(self, page, lab, notebook: str):
        self.page, self.lab, self.notebook = page, lab, notebook
        self.failures, self.problems, self.notes = [], {}, []
        self.actions, self.done = 0, set()

    def fail(self, control: dict, what: str) -> None:
        self.failures.append((control["cell"], f"{describe(control)}: {what}"))

    # ---------------------------------------------------------------- page and kernel
    def probe(self, call: str, *args):
        return self.page.evaluate(f"(a) => window.ampvizProbe.{call}(...a)", list(args))

    def scan(self, cell: int | None = None) -> list:
        return [c for c in self.probe("scan") if cell is None or c["cell"] == cell]

    def activity(self) -> str:
        return self.lab.kernel(self.notebook)["last_activity"]

    def settle(self, since: str | None = None, cell: int | None = None) -> None:
        """Wait until the kernel is idle (after ``since``, when given) and the outputs stay the same for
        STABLE_S: what an action set off has finished before the next one starts."""
        deadline = time.monotonic() + CHANGE_TIMEOUT_S
        last, stable_since = None, time.monotonic()
        while time.monotonic() < deadline:
            kernel = self.lab.kernel(self.notebook)
            now = self.probe("fingerprint", cell, None)
            if now != last:
                last, stable_since = now, time.monotonic()
            idle = kernel["execution_state"] == "idle" and (since is None or kernel["last_activity"] != since)
            if idle and time.monotonic() - stable_since >= STABLE_S:
                return
            self.page.wait_for_timeout(250)
        raise AssertionError(f"{self.notebook}: the outputs did not settle within {CHANGE_TIMEOUT_S} s")

    def act(self, control: dict, what: str, action) -> bool | None:
        """Do ``action`` (a callable that gets the control's locator) and report whether something visible
        changed: in the control's cell, or (noted) in another cell."""
        key, cell = control["key"], control["cell"]
        if not self.probe("tag", key):
            self.notes.append(f"{describe(control)}: gone from the page before {what}")
            return None
        before, before_all, since = self.probe("fingerprint", cell, key), self.probe("fingerprint", None, key), \
            self.activity()
        start = time.monotonic()
        action(self.page.locator("[data-ampviz-control]"))
        self.actions += 1
        changed, quiet = False, None
        while time.monotonic() - start < CHANGE_TIMEOUT_S:
            if self.probe("fingerprint", cell, key) != before:
                changed = True
                break
            kernel, now = self.lab.kernel(self.notebook), time.monotonic()
            heard = kernel["last_activity"] != since
            quiet = (quiet or now) if heard and kernel["execution_state"] == "idle" else None
            if (quiet and now - quiet > GRACE_S) or (not heard and now - start > NO_MESSAGE_S):
                break
            self.page.wait_for_timeout(200)
        self.settle(since if changed else None, cell)
        if not changed and self.probe("fingerprint", None, key) != before_all:
            self.notes.append(f"{describe(control)}: {what} changed another cell's outputs only")
            changed = True
        if not changed:
            self.fail(control, f"{what} changed nothing visible")
        for _, problem in self.probe("layoutProblems", cell):
            self.problems.setdefault((cell, problem), f"after {describe(control)}: {what}")
        return changed

    # ---------------------------------------------------------------- one control of each kind
    def exercise(self, control: dict, nested: bool = True) -> None:
        self.done.add(tuple(control["key"]))
        kind = control["kind"]
        if kind in ("dropdown", "select", "toggle-buttons"):
            self.choose(control, nested)
        elif kind == "slider":
            self.slide(control, nested)
        elif kind in ("checkbox", "toggle-button"):
            for what in ("on" if not control["value"] else "off", "back"):
                self.act(control, f"clicked ({what})", lambda c: (c.locator("input").click() if kind == "checkbox"
                                                                  else c.click()))
                if what != "back" and nested:
                    self.newly_enabled(control["cell"])
        elif kind == "button":
            self.act(control, "clicked", lambda c: c.click())
        elif kind in ("text", "textarea"):
            self.type_into(control)
        else:
            self.fail(control, f"the test has no driver for a {kind} control")

    def choose(self, control: dict, nested: bool) -> None:
        options, original = control["options"], control["value"]
        if control["kind"] == "toggle-buttons":        # value: the active button's index
            names = control["options"]
            enabled = [i for i, off in enumerate(control["option_disabled"]) if not off]
            picks, original_name = spread(enabled, original), names[original] if original >= 0 else None
        else:
            names, picks, original_name = options, spread(options, original), original
        if not picks:
            self.notes.append(f"{describe(control)}: a single option ({original_name}), nothing to pick")
            return
        previous = original_name
        for pick in picks + ([original] if original_name is not None else []):
            name = names[pick] if control["kind"] == "toggle-buttons" else pick
            if control["kind"] == "toggle-buttons":
                self.act(control, f"{previous} -> {name}", lambda c, i=pick: c.locator("button").nth(i).click())
            else:
                self.act(control, f"{previous} -> {name}", lambda c, v=pick: c.locator("select").select_option(v))
            previous = name
            if nested and pick != original:
                self.newly_enabled(control["cell"])

    def slide(self, control: dict, nested: bool) -> None:
        to_end = control["value"] != control["max"]
        handle = ".noUi-handle"

        def move(c):
            c.locator(handle).first.focus()
            self.page.keyboard.press("End" if to_end else "Home")
        self.act(control, f"{control['readout']} -> {'max' if to_end else 'min'}", move)
        if nested:
            self.newly_enabled(control["cell"])
        self.act(control, f"back to {control['readout']}", lambda c: self.slide_back(c, control))

    def slide_back(self, locator, control: dict) -> None:
        """Type the original readout (one change); where the readout cannot be edited or does not take it,
        step back with the arrow keys."""
        handle, target = locator.locator(".noUi-handle").first, float(control["value"])
        if control["readout_editable"] and control["readout"]:
            locator.locator(".widget-readout").first.click()
            self.page.keyboard.press("ControlOrMeta+A")
            self.page.keyboard.type(control["readout"])
            self.page.keyboard.press("Enter")
            self.page.wait_for_timeout(300)
        direction = None
        for _ in range(400):                        # each step is one message: bounded
            now = float(handle.get_attribute("aria-valuenow"))
            step = "ArrowLeft" if now > target else "ArrowRight"
            if now == target or direction not in (None, step):
                return                              # back, or as close as the slider's steps allow
            direction = step
            handle.focus()
            self.page.keyboard.press(step)
        self.notes.append(f"{describe(control)}: could not put the slider back to {control['readout']}")

    def type_into(self, control: dict) -> None:
        value = other_number(control)
        if value is None:
            self.fail(control, f"no valid value known for free text {control['value']!r}")
            return
        for text, what in ((value, f"typed {value}"), (control["value"], f"typed back {control['value']}")):
            self.act(control, what, lambda c, t=text: (c.locator("input, textarea").first.fill(t),
                                                       c.locator("input, textarea").first.press("Enter")))

    def newly_enabled(self, cell: int) -> None:
        """Use, in the state just set, the controls of ``cell`` that were disabled at the start."""
        for control in self.scan(cell):
            if tuple(control["key"]) in self.waiting and not control["disabled"]:
                self.waiting.discard(tuple(control["key"]))
                self.exercise(control, nested=False)

    # ---------------------------------------------------------------- the whole notebook
    def run(self) -> None:
        controls = self.scan()
        self.waiting = {tuple(c["key"]) for c in controls if c["disabled"]}
        order = {"slider": 1}          # sliders last in their cell: the others start from Run All's state
        for control in sorted(controls, key=lambda c: (c["cell"], order.get(c["kind"], 0))):
            if tuple(control["key"]) in self.done or tuple(control["key"]) in self.waiting:
                continue
            current = next((c for c in self.scan(control["cell"]) if c["key"] == control["key"]), None)
            if current is None:
                self.notes.append(f"{describe(control)}: no longer shown when its turn came")
            elif current["disabled"]:
                self.waiting.add(tuple(control["key"]))
            else:
                self.exercise(current)
        for key in sorted(self.waiting):
            control = next(c for c in controls if tuple(c["key"]) == key)
            self.notes.append(f"{describe(control)}: disabled in every state the test set")
        self.controls = len(controls)
