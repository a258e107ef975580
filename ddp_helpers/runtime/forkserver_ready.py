"""Imported last by the fork server (`forkserver.PRELOAD`): everything it imported is frozen, and the
garbage collector and Ctrl-C (KeyboardInterrupt), off while it imported, are on again for the ranks
(the server itself then ignores Ctrl-C again, and its ranks get these settings).

gc.freeze() moves every object there is to a permanent generation that collections skip: a rank's
collections then never walk torch's hundreds of thousands of objects, nor write to the memory they
share with the server (Python's documentation recommends it before forking).
"""
import gc
import signal

gc.freeze()
gc.enable()
signal.signal(signal.SIGINT, signal.default_int_handler)
