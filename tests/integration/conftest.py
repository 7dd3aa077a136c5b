"""Integration-suite hooks.

The long watchdog jobs of ``test_watchdog.py`` (user scripts that wait ~100 s
for the watchdog's default bound, or pause 75 s: mostly idle wall time) are
launched in the background as soon as the session is collected, so they run
beside the other modules' tests instead of after them; ``test_watchdog.py``
(last in the session) runs its short-bound jobs and collects every outcome.
"""


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    for item in session.items:
        start = getattr(item.module, "start_watchdog_jobs", None)
        if start is not None:
            start()
            return
