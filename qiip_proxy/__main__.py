# `python -m qiip_proxy`; also what each worker process (multiprocessing's spawn) imports first, as `__mp_main__`.
from qiip_proxy import _headless, main

_headless()

if __name__ == "__main__":
    main()
