from engine.coreproc.core_main import leave, main

leave(main())
